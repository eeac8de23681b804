"""A small, faithful stand-in for the ``tensorrt`` module's runtime surface (TensorRT 10.x / 11.x).

Installed as ``sys.modules["tensorrt"]`` by tests. Names, enum values and call behaviour follow
the real Python bindings (NVIDIA/TensorRT ``python/src/infer/pyCore.cpp`` and the 10.16 stubs):
``deserialize_cuda_engine`` returns None (and logs an error) for a bad or foreign plan;
``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3`` return False on misuse and
log why; ``set_optimization_profile_async`` raises RuntimeError; switching profile forgets the
input shapes; ``get_tensor_profile_shape`` gives ``[min, opt, max]``.

A "plan" here is JSON (see ``make_plan``). Each output is ``input * scale + bias`` of one input,
computed by ``execute_async_v3`` from the bytes at the input's device address (``fake_cuda.HEAP``)
and written to the output's address, so a session that copies or binds wrongly gets wrong numbers.
"""
from __future__ import annotations

import enum
import json

import numpy as np

from .fake_cuda import HEAP

__version__ = "10.3.0.26"  # JetPack 6.1's TensorRT
_MAGIC = "fake-trt-plan"


class DataType(enum.IntEnum):  # values as in TensorRT 10.16's stubs
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10
    E8M0 = 11


float32, float16, int8, int32, int64 = DataType.FLOAT, DataType.HALF, DataType.INT8, DataType.INT32, DataType.INT64
bool, uint8, bfloat16, fp8 = DataType.BOOL, DataType.UINT8, DataType.BF16, DataType.FP8  # noqa: A001


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorLocation(enum.IntEnum):
    DEVICE = 0
    HOST = 1


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    def __init__(self) -> None:
        self._initialised = True  # pybind11 refuses subclasses that skip ILogger.__init__

    def log(self, severity: "ILogger.Severity", msg: str) -> None:
        raise RuntimeError("Tried to call pure virtual function \"ILogger::log\"")


class Logger(ILogger):
    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        super().__init__()
        self.min_severity = min_severity

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        if severity <= self.min_severity:
            print(f"[TRT] [{severity.name[0]}] {msg}")


class Dims(tuple):
    pass


def volume(iterable) -> int:  # noqa: ANN001
    out = 1
    for d in iterable:
        out *= d
    return out


def nptype(trt_type: DataType) -> type:
    mapping = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
               DataType.INT32: np.int32, DataType.INT64: np.int64, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8}
    if trt_type in mapping:
        return mapping[trt_type]
    raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")


_WIRE = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
         DataType.INT64: np.int64, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.BF16: np.uint16}


def make_plan(tensors: list[dict], profiles: list[dict] | None = None, ops: dict | None = None,
              version: str = __version__) -> bytes:
    """tensors: ``{"name", "mode": "INPUT"|"OUTPUT", "dtype": "FLOAT"..., "shape": [-1, 4]}``;
    profiles: ``[{input: [min, opt, max]}]``; ops: ``{output: {"input": name, "scale": 2, "bias": 1}}``."""
    return json.dumps({"magic": _MAGIC, "version": version, "tensors": tensors,
                       "profiles": profiles or [{}], "ops": ops or {}}).encode()


class Runtime:
    def __init__(self, logger: ILogger) -> None:
        if not isinstance(logger, ILogger) or not getattr(logger, "_initialised", False):
            raise TypeError("Runtime(): incompatible constructor arguments (logger must be an initialised ILogger)")
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> "ICudaEngine | None":
        try:
            doc = json.loads(bytes(serialized_engine))
            assert doc["magic"] == _MAGIC
        except Exception:
            self.logger.log(ILogger.Severity.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                            "(Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)")
            return None
        if doc["version"] != __version__:
            self.logger.log(ILogger.Severity.ERROR, "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error "
                            f"(The engine plan file is not compatible with this version of TensorRT, expecting "
                            f"library version {__version__} got {doc['version']}, please rebuild.)")
            return None
        return ICudaEngine(doc, self.logger)


class ICudaEngine:
    def __init__(self, doc: dict, logger: ILogger) -> None:
        self._tensors = {t["name"]: t for t in doc["tensors"]}
        self._order = [t["name"] for t in doc["tensors"]]
        self._profiles = doc["profiles"]
        self._ops = doc["ops"]
        self.logger = logger
        self.contexts_created = 0

    @property
    def num_io_tensors(self) -> int:
        return len(self._order)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    def get_tensor_name(self, index: int) -> str | None:
        return self._order[index] if 0 <= index < len(self._order) else None

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode[self._tensors[name]["mode"]] if name in self._tensors else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[self._tensors[name]["dtype"]]

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(self._tensors[name]["shape"])

    def get_tensor_location(self, name: str) -> TensorLocation:
        return TensorLocation[self._tensors[name].get("location", "DEVICE")]

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        ranges = self._profiles[profile_index].get(name)
        if ranges is None or self.get_tensor_mode(name) != TensorIOMode.INPUT:
            self.logger.log(ILogger.Severity.ERROR, f"getProfileShape: {name} is not a dynamic input")
            return [Dims(), Dims(), Dims()]
        return [Dims(r) for r in ranges]

    def create_execution_context(self) -> "IExecutionContext":
        self.contexts_created += 1
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self._profile = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self.profile_switches = 0
        self.executions = 0

    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def _error(self, msg: str) -> bool:
        self.engine.logger.log(ILogger.Severity.ERROR, msg)
        return False

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not isinstance(stream_handle, int):
            raise TypeError("set_optimization_profile_async(): incompatible function arguments")
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            self._error(f"setOptimizationProfileAsync: profile index {profile_index} out of range")
            raise RuntimeError("Error in set optimization profile async.")
        self._profile = profile_index
        self._shapes.clear()  # a new profile invalidates the input shapes set so far
        self.profile_switches += 1
        return True

    def set_input_shape(self, name: str, shape) -> bool:  # noqa: ANN001
        eng = self.engine
        if eng.get_tensor_mode(name) != TensorIOMode.INPUT:
            return self._error(f"setInputShape: {name} is not an input tensor")
        shape, declared = tuple(int(d) for d in shape), tuple(eng.get_tensor_shape(name))
        if len(shape) != len(declared) or any(d >= 0 and s != d for s, d in zip(shape, declared)):
            return self._error(f"setInputShape: {name} shape {shape} does not match the engine's {declared}")
        if any(d < 0 for d in declared):
            lo, _, hi = eng.get_tensor_profile_shape(name, self._profile)
            if not all(a <= s <= b for s, a, b in zip(shape, lo, hi)):
                return self._error(f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter "
                                   f"check failed, condition: satisfyProfile. {name} {shape} is outside profile "
                                   f"{self._profile} [{tuple(lo)}, {tuple(hi)}])")
        self._shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> Dims:
        eng = self.engine
        if eng.get_tensor_mode(name) == TensorIOMode.INPUT:
            return Dims(self._shapes.get(name, tuple(eng.get_tensor_shape(name))))
        source = eng._ops[name]["input"]
        return Dims(self._shapes[source]) if source in self._shapes else eng.get_tensor_shape(name)

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE:
            return self._error(f"setTensorAddress: {name} is not an IO tensor")
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def execute_async_v3(self, stream_handle: int) -> bool:
        eng = self.engine
        if not isinstance(stream_handle, int):
            raise TypeError("execute_async_v3(): incompatible function arguments")
        for name in eng._order:
            if eng.get_tensor_mode(name) == TensorIOMode.INPUT and name not in self._shapes:
                return self._error(f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (input shape of "
                                   f"{name} not specified)")
            if name not in self._addresses:
                return self._error(f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (address of "
                                   f"{name} not set)")
        for out, op in eng._ops.items():
            src = op["input"]
            x = self._read(src, self._shapes[src])
            y = x.astype(np.float64) * op.get("scale", 1) + op.get("bias", 0)
            self._write(out, y)
        self.executions += 1
        return True

    def _read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        dtype = self.engine.get_tensor_dtype(name)
        wire = np.dtype(_WIRE[dtype])
        raw = np.frombuffer(HEAP.view(self._addresses[name], volume(shape) * wire.itemsize), dtype=wire)
        if dtype == DataType.BF16:
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return raw.reshape(shape)

    def _write(self, name: str, values: np.ndarray) -> None:
        dtype = self.engine.get_tensor_dtype(name)
        if dtype == DataType.BF16:  # truncates; tests use values bf16 holds exactly
            data = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        else:
            data = values.astype(_WIRE[dtype])
        HEAP.view(self._addresses[name], data.nbytes)[:] = data.tobytes()
