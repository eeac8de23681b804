"""openvino-genai's own NPU pipeline as a peer side of ``edge-agent bench llm`` on an NPU tier.

When the measured tier runs on the NPU (a stateful model, one sequence at a time), ``LLMPipeline(ir, "NPU")``
runs the same prompts on the same stateful IR with the same NPU properties the agent compiles with
(``npu.compile_properties`` of the tier's ``LlmShape``; the prompt and response lengths under the names the
pipeline takes, ``MAX_PROMPT_LEN`` / ``MIN_RESPONSE_LEN``). Both sides run in one process, rounds
alternating; greedy, EOS ignored, one request at a time. Prompts go in as token ids (``TokenizedInputs``)
and each token's time is taken when the pipeline hands it to a token streamer, as a user of the library
sees it. The pipeline runs on a scratch folder (links to the IR, copies of the JSON files), never on the
engine cache entry; its tokenizer IRs are made there when ``openvino_tokenizers`` can convert the model's
``tokenizer.json`` (its converter needs ``transformers``): token ids in and out need none.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..backends import npu
from ..errors import InputError, ModelError
from ..metrics.timing import RequestTiming
from ..progress import Progress
from .llm_report import _ratio

IR = "openvino_model.xml"
# The plugin's LLM-mode property names, as openvino-genai's NPU pipeline takes them
RENAMED = {"NPUW_LLM_MAX_PROMPT_LEN": "MAX_PROMPT_LEN", "NPUW_LLM_MIN_RESPONSE_LEN": "MIN_RESPONSE_LEN"}


def pipeline_properties(shape: npu.LlmShape) -> dict[str, object]:
    """The agent's NPU compile properties for ``shape``, named as ``LLMPipeline(..., "NPU", **props)`` takes them."""
    return {RENAMED.get(k, k): v for k, v in npu.compile_properties(shape).items()}


def find_ir(lm, source, explicit: str | None) -> tuple[Path | None, str | None]:
    """The stateful IR folder (or, for a plain export served as is, the export to convert) or None and why not."""
    if explicit == "none":
        return None, "skipped (--ov-genai none)"
    shape = getattr(lm, "npu_shape", None)
    if shape is None:
        return None, "not an NPU tier (openvino-genai's NPU pipeline is the peer of a tier on device NPU)"
    if importlib.util.find_spec("openvino_genai") is None:
        return None, "openvino_genai is not installed (pip install 'edge-agent[npu-genai]')"
    if explicit not in (None, "auto"):
        folder = Path(explicit)
        if not (folder / IR).is_file():
            raise InputError(f"--ov-genai {folder}: no {IR} there (a stateful IR: edge-agent build --target intel-npu)")
        return folder, None
    folder = Path(source.path)
    if (folder / IR).is_file() or (folder / "model.onnx").is_file():
        return folder, None
    return None, f"{folder} has neither {IR} nor model.onnx"


def _scratch(folder: Path, shape: npu.LlmShape, window: int | None) -> tuple[Path, dict]:
    """A scratch folder the pipeline loads: the IR (linked; made stateful from ``model.onnx`` as the agent's
    session does when the tier serves a plain export), the JSON files copied, tokenizer IRs when possible."""
    scratch = Path(tempfile.mkdtemp(prefix="edge-agent-ov-genai-"))
    info: dict = {}
    if (folder / IR).is_file():
        for name in (IR, IR.replace(".xml", ".bin")):
            if (folder / name).exists():
                (scratch / name).symlink_to((folder / name).resolve())
        info["ir"] = str(folder / IR)
    else:
        import openvino as ov

        from ..backends.openvino_stateful import make_stateful

        model = ov.Core().read_model(str(folder / "model.onnx"))
        info["conversion"] = make_stateful(model, window, shape.capacity)
        ov.save_model(model, str(scratch / IR), compress_to_fp16=False)
        info["ir"] = f"{folder / 'model.onnx'} made stateful (capacity {shape.capacity})"
    for f in folder.glob("*.json"):
        shutil.copy(f, scratch / f.name)
    info["tokenizer_irs"] = _tokenizer_irs(scratch)
    return scratch, info


def _tokenizer_irs(scratch: Path) -> str:
    if not (scratch / "tokenizer.json").is_file():
        return "not made: no tokenizer.json"
    if importlib.util.find_spec("openvino_tokenizers") is None or importlib.util.find_spec("transformers") is None:
        return "not made: openvino_tokenizers' converter needs transformers (token ids in and out need none)"
    try:
        import openvino as ov

        # imported by name: optional packages without type information
        convert_tokenizer = importlib.import_module("openvino_tokenizers").convert_tokenizer
        fast = importlib.import_module("transformers").PreTrainedTokenizerFast
        hf = fast(tokenizer_file=str(scratch / "tokenizer.json"))
        tokenizer, detokenizer = convert_tokenizer(hf, with_detokenizer=True)
        ov.save_model(tokenizer, str(scratch / "openvino_tokenizer.xml"))
        ov.save_model(detokenizer, str(scratch / "openvino_detokenizer.xml"))
    except Exception as exc:  # a tokenizer it cannot convert: the pipeline still runs on token ids
        return f"not made: {type(exc).__name__}: {exc}"
    return "made from tokenizer.json"


class OvGenaiRunner:
    """One ``openvino_genai.LLMPipeline`` on device NPU, over a scratch copy of the tier's IR folder."""

    def __init__(self, folder: Path, shape: npu.LlmShape, window: int | None = None) -> None:
        ov_genai: Any = importlib.import_module("openvino_genai")  # optional, no type information

        self._g = ov_genai
        self.properties = pipeline_properties(shape)
        self.scratch, self.info = _scratch(folder, shape, window)
        try:
            self.pipe = ov_genai.LLMPipeline(str(self.scratch), "NPU", **self.properties)
        except Exception as exc:  # the pipeline raises plain RuntimeError
            self.close()
            raise ModelError(f"openvino-genai could not load {folder} on the NPU: {exc}") from exc
        self.version = getattr(ov_genai, "__version__", "")

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float], float]:
        """Greedy, EOS ignored: exactly ``max_new_tokens``. Returns tokens, each one's time, and the start."""
        import numpy as np
        import openvino as ov

        g = self._g
        config = g.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = max_new_tokens
        config.ignore_eos = True
        config.do_sample = False
        streamer = _TokenTimes(g)
        ids = np.asarray([prompt], dtype=np.int64)
        t0 = time.perf_counter()
        inputs = g.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        self.pipe.generate(inputs, config, streamer)
        return streamer.tokens, streamer.times, t0

    def run(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sink: list, progress: Progress | None = None
    ) -> tuple[float, list[list[int]]]:
        """Every prompt, one at a time; timings into ``sink``. Returns (wall s, token ids per request)."""
        start = time.perf_counter()
        outputs = []
        for k, prompt in enumerate(prompts):
            tokens, times, t0 = self.generate(prompt, max_new_tokens)
            if not times:
                raise ModelError("openvino-genai's pipeline streamed no token")
            sink.append(RequestTiming(t0, t0, tuple(times), times[-1], len(prompt)))
            outputs.append(tokens)
            if progress is not None:
                progress.update(k + 1, len(prompts))
        return time.perf_counter() - start, outputs

    def close(self) -> None:
        self.pipe = None
        shutil.rmtree(self.scratch, ignore_errors=True)


def _TokenTimes(g: Any):
    """A streamer that keeps each token id and the time the pipeline handed it over."""
    base: Any = g.StreamerBase

    class TokenTimes(base):
        def __init__(self) -> None:
            super().__init__()
            self.tokens: list[int] = []
            self.times: list[float] = []

        def write(self, token):
            now = time.perf_counter()
            for t in token if isinstance(token, list) else [token]:
                self.tokens.append(int(t))
                self.times.append(now)
            return g.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    return TokenTimes()


# -- the report ---------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def _pooled(raw: dict[str, list[float]]) -> tuple[float | None, float | None]:
    ttft = statistics.median(raw["ttft_ms"]) if raw["ttft_ms"] else None
    itl = statistics.median(raw["itl_ms"]) if raw["itl_ms"] else None
    return ttft, (1e3 / itl if itl else None)


def token_check(ours, theirs, bare_all, vocab_limit: int | None) -> dict:
    """How many greedy tokens of the agent and the pipeline agree, position by position; where a request first
    diverges, whether the pipeline's token is one the tokenizer defines (the agent picks only those: ids past
    ``vocab_limit`` are padding of the logits), and whether the pipeline's tokens equal the bare loop's over
    every logit (``bare_all``): the same computation, without that restriction."""
    pairs = [(list(x), list(y)) for x, y in zip(ours, theirs)]
    divergences = []
    for k, (x, y) in enumerate(pairs):
        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if i is not None:
            known = vocab_limit is None or y[i] < vocab_limit
            divergences.append({"request": k, "position": i, "agent": x[i], "genai": y[i], "genai_id_known": known})
    return {
        "requests": len(pairs),
        "equal": sum(sum(1 for i, j in zip(x, y) if i == j) for x, y in pairs),
        "total": sum(max(len(x), len(y)) for x, y in pairs),
        "identical_requests": sum(1 for x, y in pairs if x == y),
        "divergences": divergences,
        "vocab_limit": vocab_limit,
        "genai_equal_to_bare_all_logits": sum(1 for x, y in zip(bare_all, theirs) if list(x) == list(y)),
    }


def summary(side: dict, runner: OvGenaiRunner, agent_rounds: list[dict], rounds: list[dict], raw: dict) -> dict:
    """The side's medians plus the agent/genai ratios: per round (median and range) and pooled over every
    request of every round."""
    side["folder"] = runner.info["ir"]
    side["properties"] = {k: v if isinstance(v, (int, float)) else str(v) for k, v in runner.properties.items()}
    side["tokenizer_irs"] = runner.info["tokenizer_irs"]
    side["version"] = runner.version
    side["mode"] = "sequential, one request at a time, LLMPipeline on NPU (greedy, EOS ignored, token ids in)"
    per_ttft = [x for a, g in zip(agent_rounds, rounds) if (x := _ratio(a["ttft_ms"]["p50"], g["ttft_ms"]["p50"]))]
    per_decode = [
        x for a, g in zip(agent_rounds, rounds) if (x := _ratio(a["decode_tokens_per_s"], g["decode_tokens_per_s"]))
    ]
    a_ttft, a_decode = _pooled(raw["agent"])
    g_ttft, g_decode = _pooled(raw["ov_genai"])
    side["agent_over_genai"] = {
        "ttft_p50": _spread(per_ttft),
        "decode_tokens_per_s": _spread(per_decode),
        "pooled": {
            "agent_ttft_p50_ms": a_ttft,
            "genai_ttft_p50_ms": g_ttft,
            "ttft_p50": _ratio(a_ttft, g_ttft),
            "agent_decode_tokens_per_s": a_decode,
            "genai_decode_tokens_per_s": g_decode,
            "decode_tokens_per_s": _ratio(a_decode, g_decode),
        },
    }
    return side


def format_lines(report: dict) -> list[str]:
    side = report.get("ov_genai")
    if side is None:
        return [f"openvino-genai (NPU): {report.get('ov_genai_reason')}"]
    r = side["agent_over_genai"]
    pooled, tok = r["pooled"], side["tokens"]

    def spread(x: dict | None) -> str:
        return "—" if x is None else f"×{x['median']:.3f} [{x['min']:.3f}–{x['max']:.3f}]"

    def num(v: float | None, digits: int = 1) -> str:
        return "—" if v is None else f"{v:.{digits}f}"

    rounds = len((r["decode_tokens_per_s"] or {}).get("rounds", []))
    unknown = [d for d in tok["divergences"] if not d["genai_id_known"]]
    why = ""
    if tok["divergences"]:
        why = (
            f"; {len(unknown)} of {len(tok['divergences'])} first divergences are the pipeline picking an id past the "
            f"tokenizer's {tok['vocab_limit']} (the agent picks known ids only)"
        )
    return [
        f"openvino-genai {side['version']} NPU pipeline on {side['folder']} (tokenizer IRs {side['tokenizer_irs']})",
        f"  TTFT p50 ms: agent {num(report['agent']['ttft_ms']['p50'])}, genai {num(side['ttft_ms']['p50'])}; "
        f"agent/genai per round {spread(r['ttft_p50'])} over {rounds} rounds, pooled "
        f"×{num(pooled['ttft_p50'], 3)} ({num(pooled['agent_ttft_p50_ms'])} / {num(pooled['genai_ttft_p50_ms'])})",
        f"  decode tok/s: agent {num(report['agent']['decode_tokens_per_s'])}, genai "
        f"{num(side['decode_tokens_per_s'])}; agent/genai per round {spread(r['decode_tokens_per_s'])}, pooled "
        f"×{num(pooled['decode_tokens_per_s'], 3)} ({num(pooled['agent_decode_tokens_per_s'])} / "
        f"{num(pooled['genai_decode_tokens_per_s'])})",
        f"  greedy tokens equal: {tok['equal']} of {tok['total']} ({tok['identical_requests']} of {tok['requests']} "
        f"requests identical){why}; the pipeline's equal the bare loop's over every logit in "
        f"{tok['genai_equal_to_bare_all_logits']} of {tok['requests']}",
    ]
