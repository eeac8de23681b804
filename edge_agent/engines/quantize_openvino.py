"""OpenVINO artifacts: IR conversion, FP16 compression, NNCF INT8 quantization and LLM weight compression.

- ``to_ir``: the ONNX model as OpenVINO IR (``model.xml`` + ``model.bin``), weights f32 or f16.
- ``quantize_int8``: NNCF post-training quantization (``nncf.quantize``) with the calibration feeds;
  ``model_type=TRANSFORMER`` for LLMs (keeps softmax/layer-norm paths in float), symmetric preset.
- ``compress_weights``: NNCF weight-only INT8 / INT4 (group-wise), symmetric or asymmetric, for LLMs:
  what the NPU and memory-bound CPU decode want; data-free, or for INT4 with NNCF's data-aware options
  (AWQ, scale estimation, GPTQ, a mixed ratio chosen by an activation metric) on calibration text
  (``compress_weights_for``: a recipe's ``[weight_only]`` with its ``openvino`` table).
- ``stateful_ir``: an LLM export as the stateful IR the NPU plugin's LLM mode compiles (KV cache as
  state, ``beam_idx``), its weights f32, f16, INT8 or symmetric INT4 (what the NPU wants).
- ``compile_blob``: compile once with ``CACHE_DIR`` inside the artifact so a later load imports the
  compiled blob instead of compiling (minutes on the NPU).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends import Precision, SessionOptions, open_session
from ..errors import BackendError, BackendUnavailable, InputError
from .quiet import folded

if TYPE_CHECKING:
    from .recipes import WeightOnlySpec

log = logging.getLogger(__name__)


def _ov():
    try:
        import openvino as ov
    except ImportError as exc:
        raise BackendUnavailable("OpenVINO builds need openvino: pip install 'edge-agent[openvino]'") from exc
    return ov


def _nncf():
    try:
        import nncf
    except ImportError as exc:
        raise BackendUnavailable("OpenVINO INT8/INT4 needs NNCF: pip install 'edge-agent[build]'") from exc
    # NNCF logs its statistics tables to a stdout handler of its own: move them to stderr.
    for handler in logging.getLogger("nncf").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)
    return nncf


def to_ir(src: Path, dst_xml: Path, fp16: bool = False) -> dict:
    ov = _ov()
    model = ov.Core().read_model(str(src))
    ov.save_model(model, str(dst_xml), compress_to_fp16=fp16)
    return {"tool": "openvino.save_model", "weights": "f16" if fp16 else "f32"}


def quantize_int8(
    src: Path,
    dst_xml: Path,
    feeds: Sequence[Mapping[str, np.ndarray]],
    workload: str,
    ignored_types: Sequence[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    ov, nncf = _ov(), _nncf()
    if not feeds:
        raise InputError("the calibration set produced no inputs; give a manifest with samples")
    model = ov.Core().read_model(str(src))
    names = [p.get_any_name() for p in model.inputs]
    seen = [0]

    def transform(item: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen[0] += 1
        if progress:
            progress(min(seen[0], len(feeds)), len(feeds))
        missing = [n for n in names if n not in item]
        if missing:
            raise InputError(f"calibration feeds lack model inputs {missing}")
        return {n: item[n] for n in names}

    kwargs = {}
    if workload == "llm":
        kwargs["model_type"] = nncf.ModelType.TRANSFORMER
    if ignored_types:
        kwargs["ignored_scope"] = nncf.IgnoredScope(types=list(ignored_types), validate=False)
    with folded("nncf"):
        quantized = nncf.quantize(
            model,
            nncf.Dataset(list(feeds), transform),
            subset_size=len(feeds),
            preset=nncf.QuantizationPreset.PERFORMANCE,
            **kwargs,
        )
    ov.save_model(quantized, str(dst_xml), compress_to_fp16=False)
    return {
        "tool": f"nncf {nncf.__version__} quantize",
        "preset": "performance (symmetric)",
        "model_type": "transformer" if workload == "llm" else "default",
        "samples": len(feeds),
        "ignored_types": list(ignored_types),
    }


def compress_weights(
    src: Path,
    dst_xml: Path,
    bits: int,
    group_size: int = 64,
    symmetric: bool = True,
    options: Mapping[str, Any] | None = None,
    dataset: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> dict:
    """NNCF weight-only compression: INT8 per channel, or INT4 in groups of ``group_size`` along K;
    ``symmetric`` picks the *_SYM mode (no zero points), else *_ASYM. INT4 ``options`` (the keys of
    ``recipes.OpenVinoInt4Spec``) go to ``nncf.compress_weights``; ``dataset``: the model's inputs for the
    data-aware ones (prefills of calibration text)."""
    ov, nncf = _ov(), _nncf()
    model = ov.Core().read_model(str(src))
    kind = "SYM" if symmetric else "ASYM"
    opts = dict(options or {})
    kwargs: dict[str, Any] = {}
    if bits == 8:
        if opts:
            raise InputError("weight_only.openvino: NNCF's data-aware options are for int4, not 8-bit weights")
        mode = getattr(nncf.CompressWeightsMode, f"INT8_{kind}")
    elif bits == 4:
        # ratio 1.0 (default): every eligible matmul in INT4; NNCF keeps embeddings and the head in INT8.
        mode = getattr(nncf.CompressWeightsMode, f"INT4_{kind}")
        kwargs = {"group_size": group_size, "ratio": float(opts.get("ratio", 1.0))}
        kwargs.update(_int4_options(nncf, opts, dataset))
    else:
        raise InputError(f"weight compression takes 4 or 8 bits, not {bits}")
    transposed = _transpose_weights(model) if "dataset" in kwargs else 0
    if dataset is not None and "dataset" in kwargs:
        kwargs["subset_size"] = min(int(opts.get("subset_size", 128)), len(dataset))
    with folded("nncf"):
        compressed = nncf.compress_weights(model, mode=mode, **kwargs)
    ov.save_model(compressed, str(dst_xml), compress_to_fp16=False)
    facts = {k: (v.value if hasattr(v, "value") else v) for k, v in kwargs.items() if k != "dataset"}
    if "dataset" in kwargs:
        facts["calibration_windows"] = len(dataset or [])
    if transposed:
        facts["matmuls_transposed"] = transposed
    return {"tool": f"nncf {nncf.__version__} compress_weights", "mode": mode.name, **facts}


def _int4_options(nncf: Any, opts: Mapping[str, Any], dataset: Sequence[Mapping[str, np.ndarray]] | None) -> dict:
    """``nncf.compress_weights`` keywords for the INT4 ``opts`` but the ratio; the dataset when an option is
    data-aware, a sensitivity metric is named or the ratio is under 1 (NNCF then ranks by activations)."""
    out: dict[str, Any] = {k: True for k in ("awq", "scale_estimation", "gptq") if opts.get(k)}
    metric = opts.get("sensitivity_metric")
    if metric:
        out["sensitivity_metric"] = getattr(nncf.SensitivityMetric, str(metric).upper())
    backup = opts.get("backup_mode")
    if backup and backup != "int8_asym":  # NNCF's default
        out["backup_mode"] = getattr(nncf.BackupMode, str(backup).upper())
    needs: list[str] = [k for k in ("awq", "scale_estimation", "gptq") if k in out]
    if metric and metric != "weight_quantization_error":
        needs.append("sensitivity_metric")
    if needs and not dataset:
        raise InputError(f"weight_only.openvino.{needs[0]} needs calibration text (weight_only.calibration)")
    if dataset and (needs or opts.get("ratio", 1.0) < 1.0 or metric):
        out["dataset"] = nncf.Dataset(list(dataset))
    return out


def _transpose_weights(model: Any) -> int:
    """MatMul(x, W[K, N]) -> MatMul(x, W^T, transpose_b = true), the same product. ONNX exports store weights
    [K, N]; NNCF's data-aware algorithms expect [N, K] (as PyTorch exports them): its GPTQ refuses the other
    layout, its scale estimation fits wrong scales on it. Returns how many MatMuls changed."""
    from openvino import opset13 as ops

    changed = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or op.get_attributes()["transpose_b"]:
            continue
        const = op.input_value(1).get_node()
        if const.get_type_name() != "Constant" or len(const.get_output_partial_shape(0)) != 2:
            continue
        weight = ops.constant(np.ascontiguousarray(const.get_data().T))
        weight.set_friendly_name(const.get_friendly_name())
        new = ops.matmul(op.input_value(0), weight, op.get_attributes()["transpose_a"], True)
        new.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(new.output(0))
        changed += 1
    return changed


def compress_weights_for(src: Path, dst_xml: Path, bits: int, spec: WeightOnlySpec, source: Any) -> dict:
    """``compress_weights`` as a recipe's ``[weight_only]`` asks: its block size and symmetry, and for INT4
    its ``openvino`` options with prefills of ``calibration`` text (tokens ``calibration_skip_tokens`` ..
    + ``calibration_tokens``, windows of 512 with BOS first) by ``source``'s tokenizer (a ``ModelRef``)."""
    options = spec.openvino.model_dump(exclude_unset=True) if spec.openvino is not None and bits == 4 else {}
    if spec.openvino is not None and bits == 4:
        options["subset_size"] = spec.openvino.subset_size
    dataset = None
    facts: dict[str, Any] = {}
    if options and spec.calibration is not None:
        from . import int4_sensitivity as sv

        ids, bos = sv.calibration_ids(source, spec.calibration, spec.calibration_skip_tokens, spec.calibration_tokens)
        model = _ov().Core().read_model(str(src))
        dataset = [llm_feeds(model, w, dict(source.config)) for w in sv.calibration_windows(ids, bos, 512)]
        facts["calibration"] = {
            "text": str(spec.calibration),
            "skip_tokens": spec.calibration_skip_tokens,
            "tokens": len(ids),
        }
    out = compress_weights(src, dst_xml, bits, spec.block, spec.symmetric, options, dataset)
    return {**out, **facts}


def llm_feeds(model: Any, ids: Sequence[int], config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One prefill of ``ids`` for an OpenVINO LLM ``model`` read from a KV-cache export: input ids, mask and
    positions, empty past keys and values (their head count and size from the model, else ``config``)."""
    n = len(ids)
    feeds: dict[str, np.ndarray] = {}
    for port in model.inputs:
        name, dtype = port.get_any_name(), port.get_element_type().to_dtype()
        if name == "input_ids":
            feeds[name] = np.asarray([ids], dtype)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, n), dtype)
        elif name == "position_ids":
            feeds[name] = np.arange(n, dtype=dtype)[None]
        elif name.startswith("past_key_values") or name.startswith("past."):
            shape = port.get_partial_shape()
            heads = shape[1].get_length() if shape[1].is_static else int(config["num_key_value_heads"])
            size = (
                shape[3].get_length()
                if shape[3].is_static
                else int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
            )
            feeds[name] = np.zeros((1, heads, 0, size), dtype)
        else:
            raise InputError(f"calibration prefills: unexpected LLM input {name!r} (not a KV-cache export)")
    return feeds


def stateful_ir(
    src: Path,
    dst_xml: Path,
    weights: str,
    group_size: int = 128,
    sliding_window: int | None = None,
    capacity: int | None = None,
) -> dict:
    """The NPU's LLM form of the export ``src`` (``backends.openvino_stateful``), its weights as
    ``weights``: ``fp32``, ``fp16``, ``int8w`` (INT8 per channel) or ``int4`` (INT4 symmetric in groups)."""
    from ..backends.openvino_stateful import make_stateful

    ov = _ov()
    model = ov.Core().read_model(str(src))
    rewrites = make_stateful(model, sliding_window, capacity)
    facts: dict = {"tool": "openvino MakeStateful", **rewrites, "weights": weights}
    if weights in ("int4", "int8w"):
        nncf = _nncf()
        if weights == "int4":
            mode, kwargs = nncf.CompressWeightsMode.INT4_SYM, {"group_size": group_size, "ratio": 1.0}
        else:
            mode, kwargs = nncf.CompressWeightsMode.INT8_SYM, {}
        with folded("nncf"):
            model = nncf.compress_weights(model, mode=mode, **kwargs)
        facts.update(compression=f"nncf {nncf.__version__} compress_weights {mode.name}", **kwargs)
    elif weights not in ("fp32", "fp16"):
        raise InputError(f"the NPU's LLM mode takes fp32, fp16, int8w or int4 weights, not {weights!r}")
    ov.save_model(model, str(dst_xml), compress_to_fp16=weights == "fp16")
    return facts


def compile_blob(
    xml: Path,
    cache_dir: Path,
    device: str,
    hint: Precision,
    threads: int = 0,
    static_shapes: Mapping[str, tuple[int, ...]] | None = None,
    extra: Mapping[str, object] | None = None,
) -> dict:
    """Compile once into ``cache_dir/openvino`` (the backend's CACHE_DIR layout); returns compile facts."""
    import time

    options = SessionOptions(
        device=device,
        precision=hint,
        threads=threads,
        cache_dir=cache_dir,
        static_shapes=static_shapes,
        extra=dict(extra or {}),
    )
    t0 = time.perf_counter()
    try:
        session = open_session(xml, "openvino", options, warmup=lambda s: None)
    except BackendError:
        raise
    compile_ms = (time.perf_counter() - t0) * 1e3
    session.close()
    blobs = list((cache_dir / "openvino").glob("*.blob")) if (cache_dir / "openvino").is_dir() else []
    return {"device": device, "compile_ms": round(compile_ms, 1), "blobs": len(blobs)}
