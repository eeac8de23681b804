"""ONNX-level precision conversions with ONNX Runtime's own tools (they ship with onnxruntime).

- ``quantize_qdq``: static INT8, QDQ format, symmetric activations and weights (zero point 0),
  per-channel weights. Symmetric Q/DQ is what TensorRT 10 and 11 build INT8 from in a strongly
  typed network, so the same file serves ONNX Runtime and TensorRT.
- ``quantize_weights_dynamic``: INT8 weights, activations quantized per call (no calibration);
  often the better choice for LLM MatMuls on CPUs, so ``calibrate`` reports both.
- ``to_fp16``: float16 weights and compute, IO kept float32 so callers feed the same arrays.
- ``optimize``: ONNX Runtime's graph optimizations saved to a file (what ``build --precision fp32``
  caches for ONNX Runtime: loading it skips the optimization pass).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailable, InputError, ModelError
from .quiet import folded

log = logging.getLogger(__name__)

METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
# Only these carry the weights worth quantizing; leaving elementwise ops in float keeps accuracy.
LLM_OPS = ["MatMul", "Gemm"]
ASR_OPS = ["MatMul", "Gemm", "Conv", "GRU", "LSTM"]


@contextlib.contextmanager
def _quiet_tools():
    """onnxruntime.quantization logs advice through the root logger; keep it for --debug only."""
    root = logging.getLogger()
    level = root.level
    if not log.isEnabledFor(logging.DEBUG):
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _onnx():
    try:
        import onnx
    except ImportError as exc:
        raise BackendUnavailable("model conversion needs the onnx package: pip install 'edge-agent[build]'") from exc
    return onnx


class _Reader:
    """ONNX Runtime's CalibrationDataReader protocol over prepared feeds, with a progress callback."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]], progress: Callable[[int, int], None] | None) -> None:
        self._feeds = list(feeds)
        self._i = 0
        self._progress = progress

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= len(self._feeds):
            return None
        item = dict(self._feeds[self._i])
        self._i += 1
        if self._progress:
            self._progress(self._i, len(self._feeds))
        return item

    def rewind(self) -> None:
        self._i = 0


def _save_external(model, dst: Path) -> None:
    """Weights over 64 MB go to ``<dst>.data`` beside the graph (protobuf's 2 GB limit aside): ONNX
    Runtime maps external data from the file, where a graph holding its weights is read whole and
    parsed into a second copy. For Gemma 3 270M's int8w engine (1.04 GB, 671 MB of it the float
    embedding table) that is 0.61 GB peak resident at load instead of 1.73 GB, and the table's rows are
    paged in as tokens use them."""
    onnx = _onnx()
    external = sum(init.ByteSize() for init in model.graph.initializer) > 64 * 2**20
    onnx.save_model(
        model,
        str(dst),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=dst.name + ".data" if external else None,
        size_threshold=1024,
    )


def _in_memory(src: Path):
    """``src`` loaded, weights included, for ONNX Runtime's quantizers: given a path, they write their
    shape-inferred copy (``<model>-inferred.onnx``) beside it, into the model's own folder, which is
    read-only where the package is installed and shared by two builds of one model at once (one
    deletes the copy the other is reading). Given the model, they work in a folder of their own."""
    return _onnx().load(str(src))


def quantize_qdq(
    src: Path,
    dst: Path,
    feeds: Sequence[Mapping[str, np.ndarray]],
    method: str = "minmax",
    op_types: Iterable[str] = LLM_OPS,
    exclude: Sequence[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Static symmetric per-channel INT8 Q/DQ. Returns what was done (for the report)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if not feeds:
        raise InputError("the calibration set produced no inputs; give a manifest with samples")
    if method not in METHODS:
        raise InputError(f"unknown calibration method {method!r}; choose {', '.join(METHODS)}")
    extra: dict[str, bool | float] = {
        "ActivationSymmetric": True,  # zero point 0: the only INT8 TensorRT 11 accepts
        "WeightSymmetric": True,
        "CalibMovingAverage": False,
    }
    if method == "percentile":
        extra["CalibPercentile"] = 99.99
    with _quiet_tools(), folded("onnxruntime.quantization"):
        quantize_static(
            _in_memory(src),
            str(dst),
            _Reader(feeds, progress),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(op_types),
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude) or None,
            calibrate_method=getattr(CalibrationMethod, METHODS[method]),
            extra_options=extra,
            use_external_data_format=_needs_external(src),
        )
    return {
        "tool": "onnxruntime.quantization.quantize_static",
        "format": "QDQ",
        "symmetric": True,
        "per_channel": True,
        "method": method,
        "samples": len(feeds),
        "op_types": list(op_types),
        "excluded_nodes": list(exclude),
    }


def quantize_weights_dynamic(
    src: Path, dst: Path, op_types: Iterable[str] = LLM_OPS, exclude: Sequence[str] = ()
) -> dict:
    """Dynamic INT8: per-channel int8 weights, activations scaled per call; ``exclude``: nodes kept float."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet_tools(), folded("onnxruntime.quantization"):
        quantize_dynamic(
            _in_memory(src),
            str(dst),
            op_types_to_quantize=list(op_types),
            per_channel=True,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude) or None,
            use_external_data_format=_needs_external(src),
            # contrib ops (GroupQueryAttention in an in-place KV graph) defeat ONNX shape inference:
            # the float32 activations they produce are then typed by this default
            extra_options={"DefaultTensorType": 1},  # onnx.TensorProto.FLOAT
        )
    return {
        "tool": "onnxruntime.quantization.quantize_dynamic",
        "weights": "int8 per-channel",
        "activations": "int8, scaled per call",
        "op_types": list(op_types),
        **({"excluded_nodes": list(exclude)} if exclude else {}),
    }


def to_fp16(src: Path, dst: Path, keep_io_types: bool = True) -> dict:
    onnx = _onnx()
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))  # pulls external data in from src's folder
    converted = convert_float_to_float16(model, keep_io_types=keep_io_types, disable_shape_infer=True)
    _save_external(converted, dst)
    return {"tool": "onnxruntime.transformers.float16", "keep_io_types": keep_io_types}


def optimize(src: Path, dst: Path, threads: int = 0) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    # EXTENDED, not ALL: ALL adds layout transforms tied to this CPU's ISA and saves poorly.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 3  # an overridable initializer (logits_to_keep) is meant, not worth a warning
    if threads:
        so.intra_op_num_threads = threads
    if _needs_external(src):
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        ort.InferenceSession(str(src), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"onnxruntime could not optimize {src}: {str(exc).splitlines()[0]}") from exc
    return {"tool": "onnxruntime graph optimizer", "level": "extended"}


def _needs_external(src: Path) -> bool:
    return Path(str(src) + ".data").is_file() or any(src.parent.glob(src.stem + "*.data"))


def copy_sidecars(model_folder: Path, dst_folder: Path, onnx_file: str) -> None:
    """Everything of the model folder except its graph and weights (config, tokenizer, vocab, ...)."""
    dst_folder.mkdir(parents=True, exist_ok=True)
    graph = {onnx_file, onnx_file + ".data", onnx_file + "_data"}
    for path in model_folder.iterdir():
        if path.is_file() and path.name not in graph and path.suffix not in (".onnx", ".data", ".npz", ".bin"):
            shutil.copy2(path, dst_folder / path.name)
