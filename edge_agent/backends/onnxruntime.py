"""ONNX Runtime backend: CPU everywhere, CUDA / TensorRT execution providers where installed.

Precision is the model's own: ONNX Runtime does not convert weights, so fp16/int8 mean a model
built for it (``edge-agent build``). The one exception is the TensorRT EP, which can build fp16
from an fp32 model, and does so only when asked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import BackendError, DeviceUnavailable, EngineError, InputError, Interrupted, ModelError
from . import SessionOptions, TensorSpec, check_feeds

log = logging.getLogger(__name__)

# ONNX tensor type strings as ONNX Runtime reports them -> numpy dtype names.
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
    "tensor(bfloat16)": "bfloat16",
}

_DEVICE_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    "openvino": ["OpenVINOExecutionProvider", "CPUExecutionProvider"],
}


def providers_for(options: SessionOptions) -> list[tuple[str, dict]]:
    """The provider list for ``options.device``, with each provider's own cache options."""
    device = options.device.lower()
    if device not in _DEVICE_PROVIDERS:
        raise BackendError(f"onnxruntime: unknown device {options.device!r}; choose one of {sorted(_DEVICE_PROVIDERS)}")
    available = set(ort.get_available_providers())
    wanted = _DEVICE_PROVIDERS[device]
    if wanted[0] not in available:
        raise DeviceUnavailable(
            f"onnxruntime: device {device!r} needs {wanted[0]}, but this onnxruntime build has only "
            f"{sorted(available)}. Install the matching build (onnxruntime-gpu for CUDA/TensorRT, "
            f"onnxruntime-openvino for OpenVINO) in place of onnxruntime, never beside it."
        )
    cache = Path(options.cache_dir) if options.cache_dir else None
    chosen: list[tuple[str, dict]] = []
    for name in wanted:
        if name not in available:
            continue
        opts: dict = {}
        if name == "TensorrtExecutionProvider":
            opts["trt_fp16_enable"] = options.precision == "fp16"
            opts["trt_int8_enable"] = options.precision == "int8"
            if cache:
                # The TRT EP never invalidates its engine cache on a TensorRT upgrade
                # (onnxruntime#22244): key the folder by runtime version.
                trt_dir = cache / f"ort-trt-{ort.__version__}"
                trt_dir.mkdir(parents=True, exist_ok=True)
                opts.update(
                    trt_engine_cache_enable=True,
                    trt_engine_cache_path=str(trt_dir),
                    trt_timing_cache_enable=True,
                    trt_timing_cache_path=str(trt_dir),
                )
        elif name == "OpenVINOExecutionProvider":
            opts["device_type"] = str(options.extra.get("openvino_device", "CPU"))
            if cache:
                opts["cache_dir"] = str(cache / "ort-openvino")
        chosen.append((name, opts))
    return chosen


def _spec(arg) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ModelError(f"onnxruntime: tensor {arg.name!r} has unsupported type {arg.type}")
    return TensorSpec(arg.name, dtype, tuple(arg.shape))


class OrtSession:
    """An ONNX Runtime ``InferenceSession`` behind the ``Session`` interface."""

    backend = "onnxruntime"

    def __init__(self, session: ort.InferenceSession, path: Path) -> None:
        self._session = session
        self.path = path
        self.inputs = tuple(_spec(a) for a in session.get_inputs())
        # initializers listed as graph inputs: defaults a caller may override (backends.optional_inputs)
        self.optional_inputs = tuple(_spec(a) for a in session.get_overridable_initializers())
        self.outputs = tuple(_spec(a) for a in session.get_outputs())
        self._output_names = [o.name for o in self.outputs]
        self.providers = tuple(session.get_providers())
        # one RunOptions for every run: ``interrupt`` (any thread) stops the run in progress and fails each
        # later one with ``Interrupted`` until ``resume``
        self.run_options = ort.RunOptions()

    def interrupt(self) -> None:
        """Stop the run in progress (ONNX Runtime checks between nodes: within a millisecond or two) and
        every later one, which raise ``Interrupted``, until ``resume``. Any thread."""
        self.run_options.terminate = True

    def resume(self) -> None:
        self.run_options.terminate = False

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, optional=self.optional_inputs)
        names = list(output_names) if output_names is not None else self._output_names
        try:
            values = self._session.run(names, dict(feeds), self.run_options)
        except Exception as exc:  # ORT raises its own pybind exception types
            raise _translate(exc, self.path) from exc
        return dict(zip(names, values))

    def run_with_binding(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None:
        """Run writing outputs into caller-owned, correctly shaped arrays (no per-call allocation)."""
        self.prepare_binding({}, {}).run(feeds, out)

    def prepare_binding(
        self, fixed_in: Mapping[str, np.ndarray], fixed_out: Mapping[str, np.ndarray]
    ) -> OrtPreparedRun:
        """An I/O binding with ``fixed_in`` and ``fixed_out`` bound once, in place (the caller keeps those
        arrays alive, contiguous and where they are); each run binds only the feeds and outputs given to it.
        A decode step of an in-place KV cache then binds three small inputs and the logits, not 2 x layers
        KV buffers (about 0.4 ms a step on a 6-layer model)."""
        check_feeds(self.inputs, fixed_in, complete=False)
        return OrtPreparedRun(self, fixed_in, fixed_out)

    def close(self) -> None:
        self._session = None  # ORT frees on garbage collection


class OrtPreparedRun:
    """One ``IOBinding`` whose fixed buffers stay bound across runs (``OrtSession.prepare_binding``)."""

    def __init__(self, owner: OrtSession, fixed_in: Mapping[str, np.ndarray], fixed_out: Mapping[str, np.ndarray]):
        self._owner = owner
        self._fixed = {**fixed_in, **fixed_out}  # referenced, so the bound memory outlives the binding
        self._per_run = [s.name for s in owner.inputs if s.name not in fixed_in]  # what each run must feed
        self._optional = {s.name for s in owner.optional_inputs}  # what a run may feed besides (logits_to_keep)
        check_feeds(owner.inputs, fixed_in, complete=False)
        self._binding = owner._session.io_binding()
        for name, value in fixed_in.items():
            if not value.flags.c_contiguous:
                raise InputError(f"input {name!r}: a bound-once buffer must be contiguous")
            self._binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        for name, buf in fixed_out.items():
            self._bind_out(name, buf)

    def _bind_out(self, name: str, buf: np.ndarray) -> None:
        if not buf.flags.c_contiguous:
            raise InputError(f"output {name!r}: a bound buffer must be contiguous")
        self._binding.bind_output(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)

    def run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None:
        owner = self._owner
        if feeds or self._per_run:  # a run with everything bound (a decode step) checks nothing again
            check_feeds(owner.inputs, feeds, complete=False, optional=owner.optional_inputs)
            missing = [n for n in self._per_run if n not in feeds]
            if missing:
                raise InputError(f"missing input(s) {missing}")
        for name, value in feeds.items():
            value = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # (which makes a scalar [1])
            if name in self._optional:  # an overridable initializer: bind_cpu_input finds only the other inputs
                self._binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
            else:
                self._binding.bind_cpu_input(name, value)
        for name, buf in out.items():
            self._bind_out(name, buf)
        try:
            owner._session.run_with_iobinding(self._binding, owner.run_options)
        except Exception as exc:
            raise _translate(exc, owner.path) from exc


def _translate(exc: Exception, path: Path) -> Exception:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    kind = type(exc).__name__
    if "terminate flag" in text:
        return Interrupted(f"onnxruntime: a run of {path.name} was interrupted")
    if kind in ("InvalidArgument", "InvalidGraph") or ("Invalid" in text and "input" in text.lower()):
        return InputError(f"onnxruntime rejected the inputs for {path.name}: {text}")
    return BackendError(f"onnxruntime failed running {path}: {text}")


def open(path: Path, options: SessionOptions) -> OrtSession:
    if path.is_dir():
        raise ModelError(f"{path} is a folder; give the .onnx file inside it")
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    so = ort.SessionOptions()
    # Warnings off: ONNX Runtime prints them straight to stderr, bypassing the agent's logging, and the
    # one every imported decoder would get (its optional logits_to_keep input, an initializer listed as
    # a graph input) is by design. Errors still surface as exceptions.
    so.log_severity_level = 3
    if options.threads:
        so.intra_op_num_threads = options.threads
        so.inter_op_num_threads = 1
    # Idle intra-op threads sleep instead of spinning: the agent runs several sessions at once (the LLM
    # tiers, the recogniser), and a pool spinning between one session's ops takes the cores the other needs.
    # Measured on 2 cores, the int4 LLM decoding beside Whisper base's passes: 3.0 -> 6.8 and 5.4 -> 10.9
    # tokens/s, and faster passes too, with spinning off; alone, no loss. extra={"allow_spinning": True}
    # restores it (one session alone on its cores).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.extra.get("allow_spinning") else "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if options.extra.get("cpu_arena") is False:
        # Intermediates come from malloc and go back on free, instead of an arena that keeps its largest
        # size for good (a decoder's 1,024-token prompt grew it by ~120 MB that later steps never used).
        so.enable_cpu_mem_arena = False
    optimized = options.extra.get("optimized_model_path")
    if optimized:
        so.optimized_model_filepath = str(optimized)
    if options.precision not in ("auto", "fp32") and options.device.lower() != "tensorrt":
        log.info(
            "onnxruntime runs %s in the precision it was exported in; %s needs an engine built for it",
            path.name,
            options.precision,
        )
    try:
        session = ort.InferenceSession(str(path), sess_options=so, providers=providers_for(options))
    except (DeviceUnavailable, BackendError):
        raise
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "external data" in text.lower() or ".data" in text:
            raise ModelError(f"{path}: its external weights file is missing or unreadable ({text})") from exc
        raise EngineError(f"{path} is not a loadable ONNX model (corrupt or truncated?): {text}") from exc
    log.debug("onnxruntime opened %s on %s", path, session.get_providers())
    return OrtSession(session, path)
