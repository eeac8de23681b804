"""What the LLM adapter needs to know about a decoder export, read from its session's inputs and outputs and
its config: layers, KV heads and head size, the KV dtype, position ids, the context, EOS and BOS.

- a plain export: ``past_key_values.{i}.key/value`` inputs give the layers and the KV shape;
- an onnxruntime-genai folder: its ``genai_config.json`` translated to the config.json fields read here;
- a stateful IR (the NPU's LLM mode): the KV cache is not among its inputs, so config.json gives it, and the
  capacity is what the runtime's state holds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..backends import Session
from ..errors import ModelError

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclass(frozen=True, slots=True)
class LlmContract:
    """What the adapter needs to know about an export, read from its I/O specs and config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    has_position_ids: bool
    max_context: int
    eos_ids: frozenset[int]
    bos_id: int | None


def read_contract(
    session: Session, config: dict, generation_config: dict, stateful_capacity: int | None = None
) -> LlmContract:
    """The contract of a plain export's session; of a stateful one (``stateful_capacity``: the tokens its
    KV state holds) from ``config``, since its cache is not among its inputs."""
    names = {s.name: s for s in session.inputs}
    for required in ("input_ids", "attention_mask"):
        if required not in names:
            raise ModelError(f"not a decoder export with a KV cache: no {required!r} input (inputs: {sorted(names)})")
    layers = sorted({int(m.group(1)) for n in names if (m := _PAST.match(n))})
    eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
    if not layers and "beam_idx" in names and stateful_capacity is not None:
        n_heads = int(config.get("num_attention_heads", 1))
        return LlmContract(
            num_layers=int(config.get("num_hidden_layers", 0)),
            num_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or int(config.get("hidden_size", n_heads)) // n_heads),
            kv_dtype="float32",
            has_position_ids="position_ids" in names,
            max_context=min(stateful_capacity, int(config.get("max_position_embeddings", stateful_capacity))),
            eos_ids=eos_ids,
            bos_id=bos if isinstance(bos, int) else None,
        )
    if not layers and "beam_idx" in names:
        raise ModelError(
            "a stateful OpenVINO IR (KV cache kept inside the model, beam_idx input) is served by "
            "openvino_genai; for this adapter export it stateless (optimum-cli export openvino "
            "--disable-stateful) or use the ONNX export"
        )
    if not layers or layers != list(range(len(layers))):
        raise ModelError(
            "the export has no past_key_values.N.key/value inputs: export it with its KV cache "
            "(optimum-cli export onnx --task text-generation-with-past)"
        )
    spec = names["past_key_values.0.key"]
    heads, head_dim = spec.shape[1], spec.shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return LlmContract(
        num_layers=len(layers),
        num_kv_heads=heads,
        head_dim=head_dim,
        kv_dtype=spec.dtype,
        has_position_ids="position_ids" in names,
        max_context=int(config.get("max_position_embeddings", 4096)),
        eos_ids=eos_ids,
        bos_id=bos if isinstance(bos, int) else None,
    )


def genai_config_as_hf(genai: dict) -> tuple[dict, str]:
    """The config.json fields the adapter reads, from an onnxruntime-genai ``genai_config.json``."""
    try:
        model = genai["model"]
        dec = model["decoder"]
        config = {
            "num_key_value_heads": dec["num_key_value_heads"],
            "num_attention_heads": dec["num_attention_heads"],
            "head_dim": dec["head_size"],
            "hidden_size": dec["hidden_size"],
            "max_position_embeddings": model["context_length"],
            "eos_token_id": model["eos_token_id"],
            "bos_token_id": model.get("bos_token_id"),
            "model_type": model["type"],
            "vocab_size": model.get("vocab_size"),
        }
        return config, dec.get("filename", "model.onnx")
    except (KeyError, TypeError) as exc:
        raise ModelError(f"genai_config.json lacks {exc} (is it an onnxruntime-genai decoder config?)") from exc


_ONNX_ITEMSIZE = {1: 4, 10: 2, 16: 2, 11: 8}  # float32, float16, bfloat16, float64


def kv_bytes_per_token(contract: LlmContract) -> int:
    """The bytes one token's keys and values take in a loaded model's KV cache (every layer)."""
    import numpy as np

    itemsize = np.dtype(contract.kv_dtype).itemsize
    return 2 * contract.num_layers * contract.num_kv_heads * contract.head_dim * itemsize


def folder_kv_bytes_per_token(folder: Path) -> int | None:
    """``kv_bytes_per_token`` of the plain ONNX export in ``folder``, read from its graph's
    ``past_key_values`` inputs and its config.json without loading it; None for any other folder (an
    onnxruntime-genai folder, an OpenVINO IR, a graph without a KV cache)."""
    graph = folder / "model.onnx"
    if not graph.is_file() or not (folder / "config.json").is_file():
        return None
    import onnx

    try:
        config = json.loads((folder / "config.json").read_text())
        inputs = onnx.load(str(graph), load_external_data=False).graph.input
    except Exception:  # an unreadable folder: its own check (the model's) says why
        return None
    keys = [i for i in inputs if (m := _PAST.match(i.name)) and m.group(2) == "key"]
    if not keys:
        return None
    tensor = keys[0].type.tensor_type
    itemsize = _ONNX_ITEMSIZE.get(tensor.elem_type)
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    if itemsize is None or len(dims) != 4:
        return None
    n_heads = int(config.get("num_attention_heads") or 1)
    heads = dims[1] or int(config.get("num_key_value_heads") or n_heads)
    head_dim = dims[3] or int(config.get("head_dim") or int(config.get("hidden_size", n_heads)) // n_heads)
    return 2 * len(keys) * heads * head_dim * itemsize
