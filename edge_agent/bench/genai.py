"""onnxruntime-genai's own generator as a third side of ``edge-agent bench llm``.

Where onnxruntime-genai can build the same model (``scripts/make-genai-model`` writes a genai folder
with the same weights), its ``og.Generator`` runs the same prompts, one request at a time like the
bare loop, in the same process and alternating with the other sides. Each token's time is taken
when ``get_next_tokens()`` returns it, as a user of that library would see it.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import InputError, ModelError
from ..metrics.timing import RequestTiming
from ..progress import Progress
from .llm_report import _median_of, _ratio


def find_genai_folder(ref, explicit: str | None) -> tuple[Path | None, str | None]:
    """The genai folder to compare with, or None and why not."""
    if explicit == "none":
        return None, "skipped (--genai none)"
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return None, "onnxruntime_genai is not installed (pip install 'edge-agent[genai]')"
    if explicit:
        folder = Path(explicit)
        if not (folder / "genai_config.json").is_file():
            raise InputError(f"--genai {folder}: no genai_config.json there (build one with scripts/make-genai-model)")
        return folder, None
    if ref.model_type == "genai":
        return Path(ref.path), None
    sibling = Path(ref.path).with_name(Path(ref.path).name + "-genai")
    if (sibling / "genai_config.json").is_file():
        return sibling, None
    return None, (
        f"no onnxruntime-genai folder of {ref.name}: build one with "
        f"`scripts/make-genai-model {ref.name}` (writes {sibling}) or pass --genai DIR"
    )


class GenaiRunner:
    """One loaded og.Model with its intra-op threads set explicitly (its default is one thread here)."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime_genai as og

        self._og = og
        self.folder = folder
        config = og.Config(str(folder))
        if threads:
            config.overlay(
                json.dumps(
                    {
                        "model": {
                            "decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}
                        }
                    }
                )
            )
        try:
            self.model = og.Model(config)
        except Exception as exc:  # og raises plain RuntimeError
            raise ModelError(f"onnxruntime-genai could not load {folder}: {exc}") from exc

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy, EOS suppressed (min_length) so every request makes exactly ``max_new_tokens``."""
        og = self._og
        params = og.GeneratorParams(self.model)
        total = len(prompt) + max_new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        generator = og.Generator(self.model, params)
        generator.append_tokens([int(t) for t in prompt])
        tokens: list[int] = []
        times: list[float] = []
        while not generator.is_done() and len(tokens) < max_new_tokens:
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            times.append(time.perf_counter())
        return tokens, times

    def run(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sink: list, progress: Progress | None = None
    ) -> tuple[float, list[list[int]]]:
        """Every prompt, one at a time; timings into ``sink``. Returns (wall s, token ids per request)."""
        start = time.perf_counter()
        outputs = []
        for k, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            tokens, times = self.generate(prompt, max_new_tokens)
            sink.append(RequestTiming(t0, t0, tuple(times), times[-1], len(prompt)))
            outputs.append(tokens)
            if progress is not None:
                progress.update(k + 1, len(prompts))
        return time.perf_counter() - start, outputs


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Fraction of positions where two runs' greedy tokens agree, up to each pair's first divergence."""
    same = total = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        total += n
        for i in range(n):
            if x[i] != y[i]:
                break
            same += 1
    return same / total if total else 0.0


def summary(rounds: list[dict], agent_rounds: list[dict], agent: dict, folder: Path | None, ours, theirs) -> dict:
    """The genai side's medians, its greedy agreement with ``ours`` and the agent/genai ratios."""
    genai = _median_of(rounds)
    genai["folder"] = str(folder)
    genai["mode"] = "sequential, one request at a time, og.Generator (greedy, EOS suppressed)"
    genai["token_agreement"] = agreement(ours, theirs)
    genai["agent_over_genai"] = {
        "ttft_p50": _ratio(agent["ttft_ms"]["p50"], genai["ttft_ms"]["p50"]),
        "tokens_per_s": _ratio(agent["tokens_per_s"], genai["tokens_per_s"]),
        "decode_tokens_per_s": _ratio(agent["decode_tokens_per_s"], genai["decode_tokens_per_s"]),
    }
    # Each round's two sides ran a few seconds apart: their ratio cancels the machine's slower drift
    pairs = zip(agent_rounds, rounds)
    paired = [x for a, g in pairs if (x := _ratio(a["decode_tokens_per_s"], g["decode_tokens_per_s"])) is not None]
    if paired:
        genai["agent_over_genai"]["decode_per_round"] = {"median": statistics.median(paired), "rounds": paired}
    return genai
