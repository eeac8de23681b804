"""Convert a plain decoder export into an in-place KV folder, and prove it decodes like the source.

A plain Phi-3 / Gemma / Gemma-2 / Gemma 3 export (inputs ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.N.key/value``; outputs ``logits``, ``present.N.key/value``) returns a new present
tensor each step, so the agent copies the whole cache per token. The converted folder has the
onnxruntime-genai layout instead (``genai_config.json`` + a GroupQueryAttention ``model.onnx`` whose
past and present are one preallocated buffer, ``past_present_share_buffer``), which the agent serves
with per-slot buffers appended in place (``models.kv_slots.SlotCache``) and onnxruntime-genai's own
generator can open too. Only numpy and onnx are needed (no torch): weights are recovered from the
graph (``inplace_kv_weights``) and a new graph is written (``graphs.inplace_kv``).

``convert_inplace`` refuses its own result unless it matches the source: last-position logits after
prefill and at every teacher-forced decode step (two prompts of different lengths in one batch,
through the agent's serving adapters), within a tolerance relative to the logit scale, and the same
greedy token at every step (``InplaceCheckFailed`` names the step and the difference).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError
from ..graphs.inplace_kv import build_graph
from .inplace_kv_weights import FAMILIES, Arch, read_arch, recover

SIDECARS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)
TOLERANCE = 1e-3  # max |Δlogit| / max(1, max |logit|): float32 kernels differ by ~1e-6 of the scale


class InplaceCheckFailed(ModelError):
    """The converted graph's logits or greedy tokens differ from the source export's."""


LAYOUT = "inplace-kv"


def layout_for(
    kv_layout: str, workload: str, folder: Path, onnx_file: str, backend: str, precision: str, flavour: str
) -> str:
    """The KV layout an engine build uses: ``LAYOUT`` for an ONNX Runtime LLM build of a plain decoder
    export whose precision only rewrites weights (fp32, int8 dynamic, int8w, int4), else "" (the source's).

    FP16 keeps float32 I/O through Cast nodes and static INT8 calibrates with the source's feeds, neither
    of which keeps past and present one buffer, so those stay plain."""
    weights_only = precision in ("fp32", "int8w", "int4") or (precision == "int8" and flavour == "dynamic")
    if kv_layout != "inplace" or workload != "llm" or backend != "onnxruntime" or not weights_only:
        return ""
    return LAYOUT if onnx_file == "model.onnx" and is_plain_decoder(folder) else ""


def is_plain_decoder(folder: Path) -> bool:
    """Whether ``folder`` is a plain decoder export this module converts (config + a KV-cache graph)."""
    if (folder / "genai_config.json").is_file() or not (folder / "model.onnx").is_file():
        return False
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") in FAMILIES
    except (OSError, ValueError):
        return False


def convert_inplace(
    src: Path, dst: Path, onnx_file: str = "model.onnx", check_tokens: int = 16, threads: int = 1
) -> dict[str, Any]:
    """Write the in-place KV folder of the plain export ``src`` into ``dst`` (replaced); a report dict.

    ``check_tokens`` > 0 runs the equivalence check (``verify_inplace``) and raises on a mismatch."""
    import onnx

    t0 = time.perf_counter()
    graph_path = src / onnx_file
    if not graph_path.is_file():
        raise ModelError(f"{src}: no {onnx_file} to convert")
    arch = read_arch(src)
    try:
        model = onnx.load(str(graph_path))
    except Exception as exc:  # onnx raises DecodeError, OSError, ValidationError…: say which file
        raise ModelError(f"{graph_path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from exc
    names = {i.name for i in model.graph.input}
    if "past_key_values.0.key" not in names or "input_ids" not in names:
        raise ModelError(
            f"{graph_path}: not a plain decoder export with a KV cache (inputs {sorted(names)[:6]}…); export it "
            f"with optimum-cli export onnx --task text-generation-with-past"
        )
    if any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        raise ModelError(f"{graph_path}: already uses GroupQueryAttention (an in-place KV graph): nothing to convert")
    weights = recover(model, arch, str(graph_path))
    del model
    new = build_graph(arch, weights)
    del weights
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    onnx.save_model(
        new, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=1024
    )
    for name in SIDECARS:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    (dst / "genai_config.json").write_text(json.dumps(genai_config(src, arch), indent=2) + "\n")
    report: dict[str, Any] = {
        "tool": "edge-agent inplace-kv (GroupQueryAttention, past_present_share_buffer)",
        "source": str(graph_path),
        "family": arch.family,
        "layers": arch.layers,
        "convert_s": round(time.perf_counter() - t0, 2),
    }
    if check_tokens > 0:
        report["check"] = verify_inplace(src, dst, check_tokens, threads)
    return report


def genai_config(src: Path, arch: Arch) -> dict[str, Any]:
    """onnxruntime-genai's ``genai_config.json`` for the converted graph (what its builder writes)."""
    cfg = json.loads((src / "config.json").read_text())
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    pad = gen.get("pad_token_id", cfg.get("pad_token_id"))
    return {
        "model": {
            "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
            "context_length": arch.context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": arch.head_dim,
                "hidden_size": arch.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": arch.heads,
                "num_hidden_layers": arch.layers,
                "num_key_value_heads": arch.kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else (eos[0] if isinstance(eos, list) else eos),
            "type": arch.family,
            "vocab_size": arch.vocab,
        },
        "search": {
            "do_sample": False,
            "max_length": arch.context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def check_prompts(vocab: int) -> list[list[int]]:
    """Two fixed prompts of different lengths (12 and 7 tokens) inside the vocabulary."""
    rng = np.random.default_rng(0)
    hi = max(4, min(vocab, 1000))
    return [rng.integers(3, hi, size=n).tolist() for n in (12, 7)]


def verify_inplace(src: Path, dst: Path, tokens: int = 16, threads: int = 1) -> dict[str, Any]:
    """Teacher-forced comparison through the serving adapters; raises ``InplaceCheckFailed`` on a mismatch."""
    from ..backends import SessionOptions
    from ..models.catalog import inspect_folder
    from ..models.llm import DecoderLM

    options = SessionOptions(threads=threads)
    plain = DecoderLM.open(inspect_folder(src), "onnxruntime", options)
    try:
        inplace = DecoderLM.open(inspect_folder(dst), "onnxruntime", options, kv_capacity=256)
    except BaseException:
        plain.close()
        raise
    try:
        prompts = check_prompts(plain._vocab or 1000)
        ref_batch, new_batch = plain.new_batch(2), inplace.new_batch(2)
        ref = plain.join(ref_batch, [0, 1], prompts)
        got = inplace.join(new_batch, [0, 1], prompts)
        worst, scale = 0.0, 0.0
        for step in range(tokens + 1):
            where = "prefill" if step == 0 else f"decode step {step}"
            diff = float(np.abs(ref - got).max())
            scale = max(scale, float(np.abs(ref).max()))
            worst = max(worst, diff / max(1.0, float(np.abs(ref).max())))
            _judge(ref, got, where, dst)
            if step == tokens:
                break
            next_ids = [int(t) for t in ref.argmax(-1)]
            ref, got = plain.decode(ref_batch, next_ids), inplace.decode(new_batch, next_ids)
        return {"tokens": tokens, "rows": 2, "max_rel_diff": worst, "logit_scale": scale, "greedy_equal": True}
    finally:
        inplace.close()
        plain.close()


def _judge(ref: np.ndarray, got: np.ndarray, where: str, dst: Path) -> None:
    for row in range(ref.shape[0]):
        r, g = ref[row], got[row]
        tol = TOLERANCE * max(1.0, float(np.abs(r).max()))
        diff = float(np.abs(r - g).max())
        if not np.isfinite(diff) or diff > tol:
            raise InplaceCheckFailed(
                f"{dst}: the converted graph differs from the source at {where}, row {row}: max |Δlogit| "
                f"{diff:.3g} > {tol:.3g} ({TOLERANCE:g} of the logit scale); the export does not match its config.json "
                f"or uses a variant this converter does not reproduce"
            )
        a, b = int(r.argmax()), int(g.argmax())
        if a != b and r[a] - r[b] > tol:  # a tie within the tolerance may pick either token
            raise InplaceCheckFailed(f"{dst}: greedy token differs at {where}, row {row}: {b} instead of {a}")
