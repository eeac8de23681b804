"""TensorRT plan builder for TensorRT 10.x (JetPack 6/7) and 11.x, from ONNX.

    precision   TensorRT 10.x                                   TensorRT 11.x
    fp32        FP32 ONNX, weakly typed network                 FP32 ONNX (every network strongly typed)
    fp16        FP32 ONNX + BuilderFlag.FP16                    FP16 ONNX (float16 in the graph, IO float32)
    int8        symmetric Q/DQ ONNX, STRONGLY_TYPED network     symmetric Q/DQ ONNX
    int8 (calibrator)  FP32 ONNX + BuilderFlag.INT8 + IInt8EntropyCalibrator2   removed: refused

TensorRT 11 removed ``BuilderFlag.FP16/INT8/BF16``, ``IInt8EntropyCalibrator2`` and
``config.int8_calibrator``: precision lives in the graph. Each recipe profile becomes one
optimization profile (LLMs: ``prefill`` and ``decode``); the timing cache is loaded before and
saved after each build (one file per TensorRT version and device). Progress and systemd
keep-alives come through ``IProgressMonitor`` (TensorRT >= 10.0).

Only documented Python API calls are used (``Builder``, ``create_network``, ``OnnxParser.parse_from_file``
/ ``parse``, ``create_builder_config``, ``set_memory_pool_limit``, ``create_optimization_profile``/``set_shape``,
``create_timing_cache``/``set_timing_cache``/``get_timing_cache``, ``build_serialized_network``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendError, BackendUnavailable, InputError

log = logging.getLogger(__name__)

Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def major_version(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise BackendError(f"cannot read the TensorRT version {version!r}") from None


def is_strongly_typed_only(version: str) -> bool:
    """TensorRT 11 builds every network strongly typed and has no FP16/INT8 builder flags."""
    return major_version(version) >= 11


def load_tensorrt() -> Any:
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise BackendUnavailable(
            "building TensorRT plans needs TensorRT from JetPack (apt install "
            f"python3-libnvinfer python3-libnvinfer-dev): {exc}"
        ) from exc


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """One TensorRT build: the ONNX graph in, the plan out, precision, profiles and the timing cache."""

    onnx: Path
    plan: Path
    precision: str  # fp32 | fp16 | int8
    profiles: Sequence[tuple[str, Shapes]]
    timing_cache: Path | None = None
    workspace_bytes: int = 1 << 30
    calibrator: Any = None  # an IInt8EntropyCalibrator2, TensorRT < 11 only (flavour "calibrator")
    extra: dict = field(default_factory=dict)
    graph: bytes | None = None  # a serialized graph parsed instead of the file ``onnx`` (whose folder has the weights)


def _logger(trt: Any) -> Any:
    from ..backends.tensorrt import _Logger

    return _Logger.for_module(trt)


def _progress_monitor(trt: Any, beat: Callable[[str, int, int], None]) -> Any | None:
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):  # type: ignore[misc, valid-type]  # TensorRT's class, known only at run time
        def __init__(self) -> None:
            super().__init__()
            self.steps: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.steps[phase_name] = num_steps
            beat(phase_name, 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            beat(phase_name, step + 1, self.steps.get(phase_name, 0))
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            beat(phase_name, self.steps.get(phase_name, 0), self.steps.get(phase_name, 0))

    return Monitor()


def build_plan(trt: Any, spec: BuildSpec, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Build and write ``spec.plan``; returns what was built (flags, profiles, timing cache use)."""
    version = str(trt.__version__)
    strongly_typed_only = is_strongly_typed_only(version)
    logger = _logger(trt)
    logger.drain()
    _check_spec(spec, version, strongly_typed_only)

    builder = trt.Builder(logger)
    # Q/DQ INT8 is built strongly typed on 10.x as on 11 (TensorRT's recommended explicit-quantization
    # path); FP32/FP16 stay weakly typed on 10.x so BuilderFlag.FP16 can pick FP16 kernels.
    strongly_typed = strongly_typed_only or (spec.precision == "int8" and spec.calibrator is None)
    if strongly_typed_only:
        flags = 0  # 11.x: strong typing is always on; its flag is deprecated and ignored
    else:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    # the parser owns the network's weights: it is held here until the plan is built and written
    network, _parser = _parse_onnx(trt, builder, logger, spec, flags)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_bytes)
    set_flags = [] if strongly_typed_only else _set_precision_flags(trt, config, spec)
    _add_profiles(builder, config, network, spec, logger)
    cache_bytes = b""
    if spec.timing_cache is not None and spec.timing_cache.is_file():
        cache_bytes = spec.timing_cache.read_bytes()
    timing = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(timing, False)  # ignore_mismatch=False: a foreign cache is rejected
    monitor = _progress_monitor(trt, progress) if progress else None
    if monitor is not None:
        config.progress_monitor = monitor

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BackendError(
            f"TensorRT {version} failed to build {spec.onnx.name} ({spec.precision}): {logger.drain() or 'no message'}"
        )
    spec.plan.parent.mkdir(parents=True, exist_ok=True)
    spec.plan.write_bytes(bytes(serialized))
    if spec.timing_cache is not None:
        _write_atomic(spec.timing_cache, bytes(config.get_timing_cache().serialize()))
    return {
        "tensorrt": version,
        "strongly_typed": strongly_typed,
        "builder_flags": set_flags,
        "profiles": [name for name, _ in spec.profiles],
        "timing_cache": str(spec.timing_cache),
        "timing_cache_reused": bool(cache_bytes),
        "plan_bytes": spec.plan.stat().st_size,
        "calibrator": type(spec.calibrator).__name__ if spec.calibrator is not None else None,
    }


def _check_spec(spec: BuildSpec, version: str, strongly_typed_only: bool) -> None:
    """Refuse what this TensorRT cannot build: another precision, a calibrator on 11.x, no profile."""
    if spec.precision not in ("fp32", "fp16", "int8"):
        raise InputError(f"TensorRT builds fp32, fp16 or int8 plans, not {spec.precision}")
    if spec.calibrator is not None and strongly_typed_only:
        raise InputError(
            f"TensorRT {version} removed the implicit INT8 calibrator; build INT8 from the "
            "symmetric Q/DQ ONNX (edge-agent calibrate makes it)"
        )
    if not spec.profiles:
        raise InputError("a TensorRT build needs at least one shape profile")


def _parse_onnx(trt: Any, builder: Any, logger: Any, spec: BuildSpec, flags: int) -> tuple[Any, Any]:
    """The network (created with ``flags``) parsed from ``spec``'s ONNX, and the parser, which owns the
    network's weights."""
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # Both read external weights beside spec.onnx (parse: from the path given with the bytes).
    onnx_file = str(spec.onnx)
    parsed = parser.parse(spec.graph, onnx_file) if spec.graph is not None else parser.parse_from_file(onnx_file)
    if not parsed:
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise InputError(
            f"TensorRT {trt.__version__} could not parse {spec.onnx}: {' | '.join(errors) or logger.drain()}"
        )
    return network, parser


def _set_precision_flags(trt: Any, config: Any, spec: BuildSpec) -> list[str]:
    """TensorRT 10.x only: FP16, or INT8 (with FP16 fallback) through the calibrator; the flags set."""
    if spec.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
        return ["FP16"]
    if spec.precision == "int8" and spec.calibrator is not None:
        config.set_flag(trt.BuilderFlag.INT8)
        config.set_flag(trt.BuilderFlag.FP16)  # layers INT8 cannot take fall back to FP16, not FP32
        config.int8_calibrator = spec.calibrator
        return ["INT8", "FP16"]
    return []


def _add_profiles(builder: Any, config: Any, network: Any, spec: BuildSpec, logger: Any) -> None:
    """One optimization profile per recipe profile; a profile naming unknown inputs, or leaving a
    dynamic input without shapes, is refused."""
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    for name, shapes in spec.profiles:
        unknown = sorted(set(shapes) - set(inputs))
        missing = sorted(n for n, s in inputs.items() if any(d < 0 for d in s) and n not in shapes)
        if unknown or missing:
            raise InputError(
                f"profile {name!r} does not match {spec.onnx.name}: unknown inputs {unknown}, "
                f"dynamic inputs without shapes {missing}"
            )
        profile = builder.create_optimization_profile()
        for tensor, (lo, opt, hi) in shapes.items():
            profile.set_shape(tensor, lo, opt, hi)
        if config.add_optimization_profile(profile) < 0:
            raise InputError(f"TensorRT rejected profile {name!r}: {logger.drain()}")


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def entropy_calibrator(trt: Any, cuda: Any, feeds: Sequence[dict], cache_file: Path) -> Any:
    """IInt8EntropyCalibrator2 over prepared feeds (batch 1 each), TensorRT < 11 only."""
    if is_strongly_typed_only(str(trt.__version__)) or not hasattr(trt, "IInt8EntropyCalibrator2"):
        raise InputError(f"TensorRT {trt.__version__} has no IInt8EntropyCalibrator2; use the Q/DQ ONNX")
    if not feeds:
        raise InputError("the calibration set produced no inputs")
    base = trt.IInt8EntropyCalibrator2

    class EntropyCalibrator(base):  # type: ignore[misc, valid-type]  # TensorRT's class, known only at run time
        def __init__(self) -> None:
            base.__init__(self)
            self.index = 0
            largest = {n: max(f[n].nbytes for f in feeds) for n in feeds[0]}
            self.buffers = {n: cuda.malloc(b) for n, b in largest.items()}
            self.stream = cuda.stream()

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self.index >= len(feeds):
                return None
            item = feeds[self.index]
            self.index += 1
            ptrs = []
            for name in names:
                cuda.copy_htod_async(self.buffers[name], np.ascontiguousarray(item[name]), self.stream)
                ptrs.append(int(self.buffers[name].ptr))
            self.stream.synchronize()  # TensorRT reads the buffers as soon as get_batch returns
            return ptrs

        def read_calibration_cache(self) -> bytes | None:
            return cache_file.read_bytes() if cache_file.is_file() else None

        def write_calibration_cache(self, cache: bytes) -> None:
            _write_atomic(cache_file, bytes(cache))

    return EntropyCalibrator()
