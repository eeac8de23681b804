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

Plans the fake builder makes from ONNX keep each IO tensor's ONNX dims (``"dims"``: ints, or the
export's dim names). Their output shapes follow the way a real engine's shape inference does for the
export contract, which names a dim alike wherever it appears: a named dim takes the size the input
dims of that name were set to (``present.N.key``'s ``total_sequence_length`` is the attention mask's),
a fixed one its value; a name no input has stays -1 (data-dependent). Such outputs come out as zeros.
"""

from __future__ import annotations

import enum
import json
from typing import ClassVar

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
bool, uint8, bfloat16, fp8 = DataType.BOOL, DataType.UINT8, DataType.BF16, DataType.FP8


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

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        raise RuntimeError('Tried to call pure virtual function "ILogger::log"')


class Logger(ILogger):
    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        super().__init__()
        self.min_severity = min_severity

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        if severity <= self.min_severity:
            print(f"[TRT] [{severity.name[0]}] {msg}")


class Dims(tuple):
    pass


def volume(iterable) -> int:
    out = 1
    for d in iterable:
        out *= d
    return out


def nptype(trt_type: DataType) -> type:
    mapping = {
        DataType.FLOAT: np.float32,
        DataType.HALF: np.float16,
        DataType.INT8: np.int8,
        DataType.INT32: np.int32,
        DataType.INT64: np.int64,
        DataType.BOOL: np.bool_,
        DataType.UINT8: np.uint8,
    }
    if trt_type in mapping:
        return mapping[trt_type]
    raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")


_WIRE = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
    DataType.INT64: np.int64,
    DataType.BOOL: np.bool_,
    DataType.UINT8: np.uint8,
    DataType.BF16: np.uint16,
}


def make_plan(
    tensors: list[dict], profiles: list[dict] | None = None, ops: dict | None = None, version: str = __version__
) -> bytes:
    """tensors: ``{"name", "mode": "INPUT"|"OUTPUT", "dtype": "FLOAT"..., "shape": [-1, 4]}``;
    profiles: ``[{input: [min, opt, max]}]``; ops: ``{output: {"input": name, "scale": 2, "bias": 1}}``."""
    return json.dumps(
        {"magic": _MAGIC, "version": version, "tensors": tensors, "profiles": profiles or [{}], "ops": ops or {}}
    ).encode()


class Runtime:
    def __init__(self, logger: ILogger) -> None:
        if not isinstance(logger, ILogger) or not getattr(logger, "_initialised", False):
            raise TypeError("Runtime(): incompatible constructor arguments (logger must be an initialised ILogger)")
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> ICudaEngine | None:
        try:
            doc = json.loads(bytes(serialized_engine))
            assert doc["magic"] == _MAGIC
        except Exception:
            self.logger.log(
                ILogger.Severity.ERROR,
                "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                "(Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)",
            )
            return None
        if doc["version"] != __version__:
            self.logger.log(
                ILogger.Severity.ERROR,
                "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error "
                f"(The engine plan file is not compatible with this version of TensorRT, expecting "
                f"library version {__version__} got {doc['version']}, please rebuild.)",
            )
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

    def create_execution_context(self) -> IExecutionContext:
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

    def set_input_shape(self, name: str, shape) -> bool:
        eng = self.engine
        if eng.get_tensor_mode(name) != TensorIOMode.INPUT:
            return self._error(f"setInputShape: {name} is not an input tensor")
        shape, declared = tuple(int(d) for d in shape), tuple(eng.get_tensor_shape(name))
        if len(shape) != len(declared) or any(d >= 0 and s != d for s, d in zip(shape, declared)):
            return self._error(f"setInputShape: {name} shape {shape} does not match the engine's {declared}")
        if any(d < 0 for d in declared):
            lo, _, hi = eng.get_tensor_profile_shape(name, self._profile)
            if not all(a <= s <= b for s, a, b in zip(shape, lo, hi)):
                return self._error(
                    f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter "
                    f"check failed, condition: satisfyProfile. {name} {shape} is outside profile "
                    f"{self._profile} [{tuple(lo)}, {tuple(hi)}])"
                )
        self._shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> Dims:
        eng = self.engine
        if eng.get_tensor_mode(name) == TensorIOMode.INPUT:
            return Dims(self._shapes.get(name, tuple(eng.get_tensor_shape(name))))
        op = eng._ops.get(name)
        if op is None:
            dims = eng._tensors[name].get("dims", eng._tensors[name]["shape"])
            return Dims(self._named_dim(d) if isinstance(d, str) else d for d in dims)
        source = op["input"]
        return Dims(self._shapes[source]) if source in self._shapes else eng.get_tensor_shape(name)

    def _named_dim(self, dim: str) -> int:
        """The size the inputs with a dim called ``dim`` were set to (-1 when none was)."""
        for name, shape in self._shapes.items():
            for axis, d in enumerate(self.engine._tensors[name].get("dims", [])):
                if d == dim:
                    return shape[axis]
        return -1

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
                return self._error(
                    f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (input shape of {name} not specified)"
                )
            if name not in self._addresses:
                return self._error(
                    f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (address of {name} not set)"
                )
        for out, op in eng._ops.items():
            src = op["input"]
            x = self._read(src, self._shapes[src])
            y = x.astype(np.float64) * op.get("scale", 1) + op.get("bias", 0)
            self._write(out, y)
        for out in eng._order:
            if eng.get_tensor_mode(out) == TensorIOMode.OUTPUT and out not in eng._ops and "dims" in eng._tensors[out]:
                shape = tuple(self.get_tensor_shape(out))
                if any(d < 0 for d in shape):
                    return self._error(f"IExecutionContext::enqueueV3: the shape of {out} is unknown")
                self._write(out, np.zeros(shape))
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


# -- builder surface (TensorRT 10.3 and 11.x) ------------------------------------------------------
#
# Follows the Python API docs (tensorrt Builder / IBuilderConfig / OnnxParser / IOptimizationProfile /
# ITimingCache / IProgressMonitor) and the 10.x -> 11.x migration guide: TensorRT 11 removed
# BuilderFlag.FP16/INT8/BF16/FP8/INT4/FP4/OBEY_/PREFER_PRECISION_CONSTRAINTS/DIRECT_IO,
# IBuilderConfig.int8_calibrator, IInt8EntropyCalibrator2 and Builder.platform_has_fast_*; its
# NetworkDefinitionCreationFlag has only STRONGLY_TYPED (= 0, ignored: every network is strongly
# typed). Building a strongly typed network with a precision flag set is an API usage error, and the
# ONNX parser accepts only symmetric Q/DQ (zero points of 0) in either version.

import builtins  # noqa: E402 - this module rebinds ``bool`` to DataType.BOOL, as tensorrt does


class NetworkDefinitionCreationFlag(enum.IntEnum):  # 10.x values
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class BuilderFlag(enum.IntEnum):  # 10.x values
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7
    SAFETY_SCOPE = 8
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    DIRECT_IO = 11
    REJECT_EMPTY_ALGORITHMS = 12
    VERSION_COMPATIBLE = 13
    EXCLUDE_LEAN_RUNTIME = 14
    FP8 = 15
    ERROR_ON_TIMING_CACHE_MISS = 16
    BF16 = 17
    DISABLE_COMPILATION_CACHE = 18
    STRIP_PLAN = 19
    REFIT_IDENTICAL = 20
    WEIGHT_STREAMING = 21
    INT4 = 22


_PRECISION_FLAGS = {"FP16", "INT8", "BF16", "FP8", "INT4"}


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class IHostMemory:
    """Serialized data; ``bytes(mem)`` copies it out, as with the real buffer-protocol object."""

    def __init__(self, data: bytes) -> None:
        self._data = bytes(data)

    def __bytes__(self) -> bytes:
        return self._data

    @property
    def nbytes(self) -> int:
        return len(self._data)


class ITensor:
    def __init__(self, name: str, shape: tuple[int, ...], dtype: DataType, dims: list | None = None) -> None:
        self.name, self.shape, self.dtype = name, Dims(shape), dtype
        self.dims = dims if dims is not None else list(shape)  # the ONNX dims: ints or dim names (fake only)


class INetworkDefinition:
    def __init__(self, flags: int, strongly_typed: bool) -> None:
        self.flags = flags
        self.strongly_typed = strongly_typed
        self._inputs: list[ITensor] = []
        self._outputs: list[ITensor] = []
        self.node_types: list[str] = []

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    def get_input(self, index: int) -> ITensor:
        return self._inputs[index]

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]

    @property
    def num_layers(self) -> int:
        return len(self.node_types)


class ParserError:
    def __init__(self, desc: str, node: int = -1) -> None:
        self._desc, self._node = desc, node

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def __str__(self) -> str:
        return f"In node {self._node} with name: : {self._desc}"


_ONNX_TYPES = {
    1: DataType.FLOAT,
    10: DataType.HALF,
    3: DataType.INT8,
    6: DataType.INT32,
    7: DataType.INT64,
    9: DataType.BOOL,
    2: DataType.UINT8,
    16: DataType.BF16,
}


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger) -> None:
        self.network, self.logger = network, logger
        self._errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError:
        return self._errors[index]

    def clear_errors(self) -> None:
        self._errors.clear()

    def parse_from_file(self, model: str) -> bool:
        try:
            import onnx

            proto = onnx.load(model)
        except Exception as exc:  # missing file or not a ModelProto
            self._errors.append(ParserError(f"Failed to parse ONNX model from file: {model} ({exc})"))
            return False
        return self._parse(proto)

    def parse(self, model: bytes, path: str | None = None) -> bool:
        """A serialized model; ``path`` (the model file's) locates its external weights."""
        import os

        import onnx
        from onnx.external_data_helper import load_external_data_for_model, uses_external_data

        try:
            proto = onnx.load_model_from_string(bytes(model))
            if any(uses_external_data(t) for t in proto.graph.initializer):
                if path is None:
                    raise ValueError("the model has external weights and no path was given to find them")
                load_external_data_for_model(proto, os.path.dirname(path))
        except Exception as exc:
            self._errors.append(ParserError(f"Failed to parse the serialized ONNX model ({exc})"))
            return False
        return self._parse(proto)

    def _parse(self, proto) -> bool:
        from onnx import numpy_helper

        inits = {i.name: i for i in proto.graph.initializer}
        for i, node in enumerate(proto.graph.node):
            if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
                zp = inits.get(node.input[2])
                if zp is not None and np.any(numpy_helper.to_array(zp) != 0):
                    self._errors.append(
                        ParserError(
                            f"Assertion failed: shiftIsAllZeros(zeroPoint): TensorRT only supports symmetric "
                            f"quantization. The zero point for the {node.op_type} operator must be all zeros.",
                            i,
                        )
                    )
            self.network.node_types.append(node.op_type)
        if self._errors:
            return False
        for value, target in ((proto.graph.input, self.network._inputs), (proto.graph.output, self.network._outputs)):
            for v in value:
                if v.name in inits:
                    continue
                onnx_dims = v.type.tensor_type.shape.dim
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in onnx_dims)
                names = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in onnx_dims]
                elem = _ONNX_TYPES.get(v.type.tensor_type.elem_type, DataType.FLOAT)
                target.append(ITensor(v.name, dims, elem, names))
        self.network.has_fp16 = any(i.data_type == 10 for i in proto.graph.initializer)
        return True


class IOptimizationProfile:
    def __init__(self, logger: ILogger) -> None:
        self.logger = logger
        self._shapes: dict[str, list[Dims]] = {}
        self.valid = True

    def set_shape(self, input: str, min, opt, max) -> None:
        lo, mid, hi = tuple(min), tuple(opt), tuple(max)
        if not (len(lo) == len(mid) == len(hi)) or not all(a <= b <= c for a, b, c in zip(lo, mid, hi)):
            self.logger.log(
                ILogger.Severity.ERROR,
                f"IOptimizationProfile::setDimensions: Error Code 3: API Usage "
                f"Error (min <= opt <= max violated for {input}: {lo} {mid} {hi})",
            )
            self.valid = False
            return
        self._shapes[input] = [Dims(lo), Dims(mid), Dims(hi)]

    def get_shape(self, input: str) -> list[Dims]:
        return self._shapes.get(input, [])


class ITimingCache:
    def __init__(self, entries: int = 0, version: str = __version__) -> None:
        self.entries, self.version = entries, version

    def serialize(self) -> IHostMemory:
        return IHostMemory(
            json.dumps({"magic": "fake-trt-timing", "version": self.version, "entries": self.entries}).encode()
        )

    def combine(self, input_cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self.entries += input_cache.entries
        return True

    def reset(self) -> bool:
        self.entries = 0
        return True


class IProgressMonitor:
    def __init__(self) -> None:
        self._initialised = True

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        raise RuntimeError('Tried to call pure virtual function "IProgressMonitor::phaseStart"')

    def step_complete(self, phase_name: str, step: int) -> bool:
        raise RuntimeError('Tried to call pure virtual function "IProgressMonitor::stepComplete"')

    def phase_finish(self, phase_name: str) -> None:
        raise RuntimeError('Tried to call pure virtual function "IProgressMonitor::phaseFinish"')


class IInt8Calibrator:
    def __init__(self) -> None:
        self._initialised = True


class IInt8EntropyCalibrator2(IInt8Calibrator):
    pass


class IBuilderConfig:
    _ATTRS: ClassVar[set[str]] = {
        "int8_calibrator",
        "progress_monitor",
        "builder_optimization_level",
        "profiling_verbosity",
        "default_device_type",
        "DLA_core",
        "avg_timing_iterations",
        "engine_capability",
    }

    def __init__(self, builder: Builder) -> None:
        object.__setattr__(self, "_builder", builder)
        object.__setattr__(self, "_flags", set())
        object.__setattr__(self, "_pools", {})
        object.__setattr__(self, "_profiles", [])
        object.__setattr__(self, "_timing", None)
        object.__setattr__(self, "_values", {"progress_monitor": None, "int8_calibrator": None})

    def __setattr__(self, name: str, value) -> None:
        if name not in self._ATTRS:
            raise AttributeError(f"'tensorrt.tensorrt.IBuilderConfig' object has no attribute '{name}'")
        self._values[name] = value

    def __getattr__(self, name: str):
        if name in type(self)._ATTRS:
            return self._values.get(name)
        raise AttributeError(f"'tensorrt.tensorrt.IBuilderConfig' object has no attribute '{name}'")

    def set_flag(self, flag: enum.IntEnum) -> None:
        self._flags.add(flag.name)

    def get_flag(self, flag: enum.IntEnum) -> bool:
        return flag.name in self._flags

    def clear_flag(self, flag: enum.IntEnum) -> None:
        self._flags.discard(flag.name)

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self._pools[pool] = int(pool_size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self._pools.get(pool, 0)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile.valid:
            return -1
        self._profiles.append(profile)
        return len(self._profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        data = bytes(serialized_timing_cache)
        if not data:
            return ITimingCache(0, self._builder._version)
        try:
            doc = json.loads(data)
            assert doc["magic"] == "fake-trt-timing"
            return ITimingCache(int(doc["entries"]), str(doc["version"]))
        except Exception:
            self._builder.logger.log(ILogger.Severity.WARNING, "Corrupt timing cache blob ignored; starting empty")
            return ITimingCache(0, self._builder._version)

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        if cache.version != self._builder._version and not ignore_mismatch:
            self._builder.logger.log(
                ILogger.Severity.ERROR,
                "IBuilderConfig::setTimingCache: the timing cache was "
                f"built by TensorRT {cache.version}, not {self._builder._version}",
            )
            return False
        object.__setattr__(self, "_timing", cache)
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing


class Builder:
    _version = __version__
    _flags_enum = NetworkDefinitionCreationFlag

    def __init__(self, logger: ILogger) -> None:
        if not isinstance(logger, ILogger) or not getattr(logger, "_initialised", False):
            raise TypeError("Builder(): incompatible constructor arguments (logger must be an initialised ILogger)")
        self.logger = logger
        self.num_DLA_cores = 0
        self.builds = 0

    @property
    def platform_has_fast_fp16(self) -> bool:
        return True

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        strongly = builtins.bool(flags & (1 << int(self._flags_enum.STRONGLY_TYPED)))
        return INetworkDefinition(int(flags), strongly)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig(self)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile(self.logger)

    def _error(self, msg: str) -> None:
        self.logger.log(ILogger.Severity.ERROR, msg)

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        precision = sorted(config._flags & _PRECISION_FLAGS)
        if network.strongly_typed and precision:
            self._error(
                f"IBuilder::buildSerializedNetwork: Error Code 3: API Usage Error (builder flags {precision} "
                f"are not allowed for a strongly typed network)"
            )
            return None
        dynamic = [t for t in network._inputs if any(d < 0 for d in t.shape)]
        if dynamic and not config._profiles:
            self._error("Network has dynamic or shape inputs, but no optimization profile has been defined.")
            return None
        for p, profile in enumerate(config._profiles):
            for t in dynamic:
                shapes = profile.get_shape(t.name)
                if not shapes:
                    self._error(f"{t.name}: optimization profile {p} is missing values for dynamic input")
                    return None
                for s in shapes:
                    if len(s) != len(t.shape) or any(d >= 0 and v != d for v, d in zip(s, t.shape)):
                        self._error(f"{t.name}: profile {p} dimensions {tuple(s)} do not match the network {t.shape}")
                        return None
        calibrated = 0
        if "INT8" in config._flags and config._values.get("int8_calibrator") is not None:
            calib = config._values["int8_calibrator"]
            names = [t.name for t in network._inputs]
            assert calib.get_batch_size() >= 1
            while calib.get_batch(names) is not None:
                calibrated += 1
            calib.write_calibration_cache(json.dumps({"batches": calibrated}).encode())
        monitor = config._values.get("progress_monitor")
        if monitor is not None:
            monitor.phase_start("Building engine", None, len(config._profiles) or 1)
            for step in range(len(config._profiles) or 1):
                if monitor.step_complete("Building engine", step) is False:
                    self._error("Build cancelled by the progress monitor")
                    return None
            monitor.phase_finish("Building engine")
        if config._timing is not None and "DISABLE_TIMING_CACHE" not in config._flags:
            config._timing.entries += network.num_layers
        tensors = [
            {"name": t.name, "mode": mode, "dtype": t.dtype.name, "shape": list(t.shape), "dims": t.dims}
            for mode, group in (("INPUT", network._inputs), ("OUTPUT", network._outputs))
            for t in group
        ]
        profiles = [{t.name: [list(s) for s in prof.get_shape(t.name)] for t in dynamic} for prof in config._profiles]
        first = network._inputs[0] if network._inputs else None
        # an output shaped like the first input copies it; the others come out as zeros of their inferred shape
        ops = {t.name: {"input": first.name} for t in network._outputs if first and t.dims == first.dims}
        doc = json.loads(make_plan(tensors, profiles or [{}], ops, version=self._version))
        doc["build"] = {
            "flags": sorted(config._flags),
            "strongly_typed": network.strongly_typed,
            "calibration_batches": calibrated,
            "has_fp16_weights": getattr(network, "has_fp16", False),
            "workspace": config._pools.get(MemoryPoolType.WORKSPACE),
        }
        self.builds += 1
        return IHostMemory(json.dumps(doc).encode())


def as_version(version: str):
    """This module as TensorRT ``version`` would present it (11.x: weak typing and calibrators removed)."""
    import sys
    import types

    mod = types.ModuleType("tensorrt")
    mod.__dict__.update({k: v for k, v in sys.modules[__name__].__dict__.items() if not k.startswith("__")})
    mod.__version__ = version
    if int(version.split(".")[0]) >= 11:
        mod.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 0})
        mod.BuilderFlag = enum.IntEnum(
            "BuilderFlag",
            {
                f.name: f.value
                for f in BuilderFlag
                if f.name
                not in _PRECISION_FLAGS | {"OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO"}
            },
        )
        del mod.IInt8EntropyCalibrator2
        config_cls = type("IBuilderConfig", (IBuilderConfig,), {"_ATTRS": IBuilderConfig._ATTRS - {"int8_calibrator"}})

        class Builder11(Builder):
            _version = version
            _flags_enum = mod.NetworkDefinitionCreationFlag

            @property
            def platform_has_fast_fp16(self) -> bool:
                raise AttributeError("'tensorrt.tensorrt.Builder' object has no attribute 'platform_has_fast_fp16'")

            def create_network(self, flags: int = 0) -> INetworkDefinition:
                return INetworkDefinition(int(flags), True)  # always strongly typed

            def create_builder_config(self) -> IBuilderConfig:
                return config_cls(self)

        mod.Builder = Builder11
        mod.IBuilderConfig = config_cls
    else:
        mod.Builder = type("Builder", (Builder,), {"_version": version})
    return mod
