"""TensorRT backend: a serialized engine (plan) run with the TensorRT 10/11 name-based tensor API.

One execution context, one stream, and for every IO tensor one device buffer and one pinned host
buffer sized for the largest shape any optimization profile allows, so ``run`` never allocates.
Engines with several profiles (LLM prefill and decode) switch profile per call: the first profile
whose min..max ranges hold the feed shapes wins.

Only runtime calls are used here; the TensorRT 11 migration guide removes builder flags,
calibrators and V2 APIs, not these, so the same code serves JetPack 6 (TensorRT 10.3) and 11.x.
CUDA memory comes from ``backends.cuda`` (cuda-python or pycuda); pass a ready ``Cuda`` as
``SessionOptions.extra["cuda"]`` or pick one with ``extra["cuda_api"]``.

IO dtypes: FP32, FP16, INT8, UINT8, INT32, INT64 and BOOL map to numpy. BF16 IO tensors are shown
to callers as float32 and converted on the host (numpy has no bfloat16; bf16 widens to fp32
exactly, and the fp32 -> bf16 rounding is the nearest-even a cast layer would do). FP8, INT4, FP4
and E8M0 IO tensors are refused: keep those types inside the network.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np

from ..errors import BackendError, BackendUnavailable, EngineError, InputError, ModelError
from . import BACKENDS, SessionOptions, TensorSpec, check_feeds
from .cuda import Cuda, DeviceBuffer, select_cuda

log = logging.getLogger(__name__)

_NUMPY_TYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
}

Shape = tuple[int, ...]


def open(path: Path, options: SessionOptions) -> TensorRTSession:
    trt = _import_tensorrt()
    injected = options.extra.get("cuda")  # a CUDA layer given by the caller (the tests' fake)
    if injected is not None:
        cuda = cast("Cuda", injected)
    else:
        # CUDA first: deserializing a plan with no usable GPU segfaults instead of failing.
        prefer = options.extra.get("cuda_api")
        cuda = select_cuda(prefer if isinstance(prefer, str) else None, _device_index(options.device))
    if options.precision != "auto":
        log.debug("tensorrt: precision %r ignored; an engine's precision is fixed when it is built", options.precision)
    return TensorRTSession(Path(path), trt, cuda)


def _import_tensorrt() -> Any:
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise BackendUnavailable(f"tensorrt failed to import: {exc}. {BACKENDS['tensorrt'].install_hint}") from exc


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


@dataclass(slots=True)
class _Tensor:
    name: str
    is_input: bool
    dtype: np.dtype  # what callers see
    wire: np.dtype  # what the engine reads and writes (uint16 for bf16)
    shape: Shape  # the engine's shape, -1 for dynamic dims
    ranges: list[tuple[Shape, Shape, Shape]]  # inputs: (min, opt, max) per profile
    device: DeviceBuffer | None = None
    host: np.ndarray | None = None  # 1-D pinned, ``wire`` dtype


class _Logger:
    """Routes TensorRT's log into Python logging and keeps the last errors for exception messages.

    TensorRT keeps one logger per process (a Runtime made with a different one gets a warning and
    the first one anyway), so there is one of these per ``tensorrt`` module, shared by sessions.
    """

    _instances: ClassVar[dict[int, Any]] = {}

    @classmethod
    def for_module(cls, trt: Any) -> Any:
        if id(trt) not in cls._instances:
            cls._instances[id(trt)] = cls._build(trt)
        return cls._instances[id(trt)]

    @staticmethod
    def _build(trt: Any) -> Any:
        sev = trt.ILogger.Severity
        levels = {
            sev.INTERNAL_ERROR: logging.CRITICAL,
            sev.ERROR: logging.ERROR,
            sev.WARNING: logging.WARNING,
            sev.INFO: logging.DEBUG,
            sev.VERBOSE: logging.DEBUG,
        }
        trt_log = logging.getLogger(__name__ + ".trt")

        class Logger(trt.ILogger):
            def __init__(self) -> None:
                trt.ILogger.__init__(self)  # pybind11 needs the base initialised explicitly
                self.errors: collections.deque[str] = collections.deque(maxlen=8)

            def log(self, severity: Any, msg: str) -> None:
                level = levels.get(severity, logging.DEBUG)
                if level >= logging.ERROR:
                    self.errors.append(msg)
                trt_log.log(level, "%s", msg)

            def drain(self) -> str:
                text = " | ".join(self.errors)
                self.errors.clear()
                return text

        return Logger()


class TensorRTSession:
    """A deserialized TensorRT engine and its execution context behind the ``Session`` interface."""

    backend = "tensorrt"

    def __init__(self, path: Path, trt: Any, cuda: Cuda) -> None:
        self.path = path
        self.last_gpu_ms: float | None = None
        self._trt, self._cuda = trt, cuda
        self._closed = False
        self._profile = 0  # a new context starts on profile 0
        self._profiles: tuple[dict[str, tuple[Shape, Shape, Shape]], ...] = ()
        self._tensors: list[_Tensor] = []
        # TensorRT and CUDA objects (untyped bindings); None until loaded and after close
        self._stream: Any = None
        self._start: Any = None
        self._end: Any = None
        self._context: Any = None
        self._engine: Any = None
        self._runtime: Any = None
        self._logger = _Logger.for_module(trt)
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # -- loading -------------------------------------------------------------------------------

    def _load(self) -> None:
        trt, cuda = self._trt, self._cuda
        try:
            plan = self.path.read_bytes()
        except OSError as exc:
            raise ModelError(f"cannot read TensorRT engine {self.path}: {exc.strerror or exc}") from exc
        self._runtime = trt.Runtime(self._logger)
        self._logger.drain()
        try:
            self._engine = self._runtime.deserialize_cuda_engine(plan)
        except Exception as exc:  # pybind raises on some malformed inputs instead of returning None
            self._engine = None
            self._logger.errors.append(str(exc))
        if self._engine is None:
            raise EngineError(
                f"TensorRT {trt.__version__} cannot load engine {self.path}: the plan is corrupt, or was built "
                f"for another TensorRT version or GPU (this one: {_gpu(cuda)}). Rebuild it on this device "
                f"(edge-agent build). TensorRT said: {self._logger.drain() or 'nothing'}"
            )
        engine = self._engine
        n_profiles = max(int(engine.num_optimization_profiles), 1)
        for i in range(engine.num_io_tensors):
            self._tensors.append(self._describe(engine, engine.get_tensor_name(i), n_profiles))
        self._context = engine.create_execution_context()
        if self._context is None:
            raise BackendError(
                f"TensorRT could not create an execution context for {self.path} "
                f"(out of GPU memory?): {self._logger.drain()}"
            )
        self._stream, self._start, self._end = cuda.stream(), cuda.event(), cuda.event()
        for t, nbytes in zip(self._tensors, self._max_nbytes(n_profiles)):
            t.device = cuda.malloc(nbytes)
            t.host = cuda.pinned((nbytes // t.wire.itemsize,), t.wire)
        self._profiles = tuple({t.name: t.ranges[p] for t in self._tensors if t.is_input} for p in range(n_profiles))
        self.inputs = tuple(self._spec(t) for t in self._tensors if t.is_input)
        self.outputs = tuple(self._spec(t) for t in self._tensors if not t.is_input)
        log.info(
            "tensorrt: loaded %s (%d inputs, %d outputs, %d profile(s)) on %s",
            self.path,
            len(self.inputs),
            len(self.outputs),
            n_profiles,
            _gpu(cuda),
        )

    def _describe(self, engine: Any, name: str, n_profiles: int) -> _Tensor:
        trt = self._trt
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        if engine.get_tensor_location(name) == trt.TensorLocation.HOST:
            raise EngineError(
                f"{self.path}: tensor {name!r} is a host (shape) tensor, which this backend does "
                f"not feed; export the model without shape-tensor inputs"
            )
        type_name = engine.get_tensor_dtype(name).name
        if type_name == "BF16":
            dtype, wire = np.dtype(np.float32), np.dtype(np.uint16)
        elif type_name in _NUMPY_TYPES:
            dtype = wire = np.dtype(_NUMPY_TYPES[type_name])
        else:
            raise EngineError(
                f"{self.path}: IO tensor {name!r} has TensorRT type {type_name}, which numpy cannot "
                f"hold; rebuild with FP32/FP16/BF16 inputs and outputs (keep {type_name} inside)"
            )
        shape = _ints(engine.get_tensor_shape(name))
        ranges = []
        if is_input:
            for p in range(n_profiles):
                if all(d >= 0 for d in shape):
                    ranges.append((shape, shape, shape))
                else:
                    lo, opt, hi = engine.get_tensor_profile_shape(name, p)
                    ranges.append((_ints(lo), _ints(opt), _ints(hi)))
        return _Tensor(name, is_input, dtype, wire, shape, ranges)

    def _max_nbytes(self, n_profiles: int) -> list[int]:
        """Bytes per tensor for the largest shapes over all profiles (outputs: as TensorRT infers them)."""
        context, sizes = self._context, [0] * len(self._tensors)
        for p in range(n_profiles):
            self._use_profile(p)
            for t in self._tensors:
                if t.is_input and not context.set_input_shape(t.name, t.ranges[p][2]):
                    raise EngineError(
                        f"{self.path}: profile {p} max shape of {t.name!r} rejected: {self._logger.drain()}"
                    )
            for i, t in enumerate(self._tensors):
                shape = t.ranges[p][2] if t.is_input else _ints(context.get_tensor_shape(t.name))
                if any(d < 0 for d in shape):
                    raise EngineError(
                        f"{self.path}: output {t.name!r} has a data-dependent shape {shape}; "
                        f"this backend needs shapes that follow from the input shapes"
                    )
                sizes[i] = max(sizes[i], int(np.prod(shape, dtype=np.int64)) * t.wire.itemsize)
        self._stream.synchronize()
        return sizes

    @staticmethod
    def _spec(t: _Tensor) -> TensorSpec:
        return TensorSpec(t.name, t.dtype.name, tuple(d if d >= 0 else None for d in t.shape))

    @property
    def io_buffer_bytes(self) -> dict[str, int]:
        """Device bytes held per IO tensor (each also has a pinned host copy of the same size): the largest
        shape any profile allows, e.g. ``logits`` at the most sequences times positions times vocabulary."""
        return {t.name: t.device.nbytes for t in self._tensors if t.device is not None}

    @property
    def profiles(self) -> tuple[dict[str, tuple[Shape, Shape, Shape]], ...]:
        """Per optimization profile: input name -> (min, opt, max) shape."""
        return self._profiles

    def warmup_feeds(self) -> dict[str, np.ndarray]:
        """Zero feeds at the first profile's minimum shapes: the smallest shapes the engine accepts."""
        by_name = {s.name: s for s in self.inputs}
        return {
            name: np.zeros(ranges[0], dtype=np.dtype(by_name[name].dtype)) for name, ranges in self._profiles[0].items()
        }

    # -- running -------------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if self._closed:
            raise BackendError(f"tensorrt session for {self.path} is closed")
        check_feeds(self.inputs, feeds)
        outputs = [t for t in self._tensors if not t.is_input]
        if output_names is not None:
            unknown = sorted(set(output_names) - {t.name for t in outputs})
            if unknown:
                raise InputError(f"unknown output(s) {unknown}; the model gives {[t.name for t in outputs]}")
            outputs = [t for t in outputs if t.name in set(output_names)]
        cuda, context, stream = self._cuda, self._context, self._stream
        assert context is not None and stream is not None
        self._use_profile(self._choose_profile({n: tuple(a.shape) for n, a in feeds.items()}))
        for t in self._tensors:
            device, pinned = t.device, t.host
            assert device is not None and pinned is not None  # allocated at load, freed only by close
            if t.is_input:
                value = feeds[t.name]
                if not context.set_input_shape(t.name, value.shape):
                    raise InputError(f"TensorRT rejected shape {value.shape} for {t.name!r}: {self._logger.drain()}")
                host = pinned[: value.size]
                host[...] = _to_bf16(value).reshape(-1) if t.wire != t.dtype else value.reshape(-1)
                cuda.copy_htod_async(device, host, stream)
            if not context.set_tensor_address(t.name, device.ptr):
                raise BackendError(f"TensorRT rejected the buffer address of {t.name!r}: {self._logger.drain()}")
        cuda.record(self._start, stream)
        if not context.execute_async_v3(stream.handle):
            stream.synchronize()
            raise BackendError(f"TensorRT execution of {self.path} failed: {self._logger.drain() or 'no message'}")
        cuda.record(self._end, stream)
        pending = []
        for t in outputs:
            shape = _ints(context.get_tensor_shape(t.name))
            device, pinned = t.device, t.host
            assert device is not None and pinned is not None  # allocated at load, freed only by close
            host = pinned[: int(np.prod(shape, dtype=np.int64))]
            cuda.copy_dtoh_async(host, device, stream)
            pending.append((t, host, shape))
        stream.synchronize()
        self.last_gpu_ms = cuda.elapsed_ms(self._start, self._end)
        return {
            t.name: (_from_bf16(host) if t.wire != t.dtype else host.copy()).reshape(shape)
            for t, host, shape in pending
        }

    def _choose_profile(self, shapes: Mapping[str, Shape]) -> int:
        profiles = self._profiles
        for p, ranges in enumerate(profiles):
            if all(_within(shapes[name], lo, hi) for name, (lo, _, hi) in ranges.items()):
                return p
        listing = "; ".join(
            f"profile {p}: " + ", ".join(f"{name} {lo}..{hi}" for name, (lo, _, hi) in ranges.items())
            for p, ranges in enumerate(profiles)
        )
        raise InputError(
            f"input shapes {dict(shapes)} fit none of the optimization profiles of {self.path.name} ({listing})"
        )

    def _use_profile(self, profile: int) -> None:
        if profile == self._profile:
            return
        try:
            self._context.set_optimization_profile_async(profile, self._stream.handle)
        except RuntimeError as exc:  # the binding raises rather than returning False
            raise BackendError(f"TensorRT could not switch to profile {profile}: {exc} {self._logger.drain()}") from exc
        self._profile = profile

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            try:
                self._stream.synchronize()  # never free memory a queued copy or kernel still uses
            except BackendError as exc:
                log.warning("tensorrt: stream synchronize at close failed: %s", exc)
        for t in self._tensors:
            if t.device is not None:
                t.device.free()
            if t.host is not None:
                self._cuda.free_pinned(t.host)
            t.device = t.host = None
        for handle in (self._start, self._end, self._stream):
            if handle is not None:
                handle.close()
        # Context before engine before runtime: each holds the one before it.
        self._context = None
        self._engine = None
        self._runtime = None


def _ints(dims: Any) -> Shape:
    return tuple(int(d) for d in dims)


def _within(shape: Shape, lo: Shape, hi: Shape) -> bool:
    return len(shape) == len(lo) and all(a <= s <= b for s, a, b in zip(shape, lo, hi))


def _to_bf16(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _gpu(cuda: Cuda) -> str:
    try:
        index = getattr(cuda, "device", 0)
        major, minor = cuda.compute_capability(index)
        return f"{cuda.device_name(index)} sm_{major}{minor}"
    except Exception:  # only for messages
        return "unknown GPU"


def probe_tensorrt(timeout_s: float = 20.0) -> dict[str, Any]:
    """{installed, version, error} without importing TensorRT here: the import runs in a subprocess,
    because a TensorRT import or deserialize on a machine without a working GPU can segfault."""
    try:
        found = importlib.util.find_spec("tensorrt") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return {"installed": False, "version": None, "error": None}
    from .probe import run_probe  # the crash-safe subprocess runner (doctor uses it too)

    result = run_probe("import json, tensorrt\nprint(json.dumps({'version': tensorrt.__version__}))", timeout_s)
    if result.error:
        return {"installed": True, "version": None, "error": result.error}
    return {"installed": True, "version": str(result.data.get("version")), "error": None}
