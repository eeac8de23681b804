"""OpenVINO artifacts: IR conversion, FP16 compression, NNCF INT8 quantization and LLM weight compression.

- ``to_ir``: the ONNX model as OpenVINO IR (``model.xml`` + ``model.bin``), weights f32 or f16.
- ``quantize_int8``: NNCF post-training quantization (``nncf.quantize``) with the calibration feeds;
  ``model_type=TRANSFORMER`` for LLMs (keeps softmax/layer-norm paths in float), symmetric preset.
- ``compress_weights``: NNCF weight-only INT8 / INT4 (group-wise), symmetric or asymmetric, for LLMs:
  what the NPU and memory-bound CPU decode want; no calibration data needed.
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

import numpy as np

from ..backends import Precision, SessionOptions, open_session
from ..errors import BackendError, BackendUnavailable, InputError
from .quiet import folded

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


def compress_weights(src: Path, dst_xml: Path, bits: int, group_size: int = 64, symmetric: bool = True) -> dict:
    """NNCF weight-only compression: INT8 per channel, or INT4 in groups of ``group_size`` along K;
    ``symmetric`` picks the *_SYM mode (no zero points), else *_ASYM."""
    ov, nncf = _ov(), _nncf()
    model = ov.Core().read_model(str(src))
    kind = "SYM" if symmetric else "ASYM"
    if bits == 8:
        mode, kwargs = getattr(nncf.CompressWeightsMode, f"INT8_{kind}"), {}
    elif bits == 4:
        # ratio 1.0: every eligible matmul in INT4; NNCF keeps embeddings and the head in INT8.
        mode, kwargs = getattr(nncf.CompressWeightsMode, f"INT4_{kind}"), {"group_size": group_size, "ratio": 1.0}
    else:
        raise InputError(f"weight compression takes 4 or 8 bits, not {bits}")
    with folded("nncf"):
        compressed = nncf.compress_weights(model, mode=mode, **kwargs)
    ov.save_model(compressed, str(dst_xml), compress_to_fp16=False)
    return {"tool": f"nncf {nncf.__version__} compress_weights", "mode": mode.name, **kwargs}


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
