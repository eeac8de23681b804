"""OpenVINO backend: CPU, GPU, NPU or AUTO, from ONNX or OpenVINO IR.

Two OpenVINO habits this module overrides on purpose:
- On CPUs with bf16 units OpenVINO silently computes in bf16. Precision here is explicit: an
  fp32 (or "auto") request pins ``INFERENCE_PRECISION_HINT=f32``.
- The NPU compiles only static shapes, so a model with dynamic dims must be reshaped first;
  ``SessionOptions.static_shapes`` gives the shapes, and their absence is a clear error.

LLMs run on the NPU only in the NPU plugin's LLM mode: a stateful IR (the KV cache kept in the infer
request, a ``beam_idx`` input) compiled with a prompt length and KV capacity
(``SessionOptions.extra["npu_llm"]``, an ``npu.LlmShape``). Such a session says ``stateful`` and
``reset_state()`` starts a new sequence. ``npu.py`` has the plugin's properties and its emulation on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import openvino as ov

from ..errors import BackendError, DeviceUnavailable, EngineError, InputError, ModelError
from . import SessionOptions, TensorSpec, check_feeds, npu

log = logging.getLogger(__name__)

_PRECISION_HINT = {"auto": "f32", "fp32": "f32", "fp16": "f16", "bf16": "bf16"}


def _dtype(element_type: ov.Type) -> str:
    try:
        return np.dtype(element_type.to_dtype()).name
    except Exception:  # bf16 and friends have no numpy dtype
        return str(element_type)


def _spec(port, fallback: str) -> TensorSpec:
    names = port.get_names()
    # A port can carry several names once conversion merged tensors ({"/Concat_output_0",
    # "past_key_values.0.key"}); the public one is the one without the exporter's "/" path.
    public = sorted(n for n in names if not n.startswith("/"))
    name = public[0] if public else port.get_any_name() if names else fallback
    shape = tuple(d.get_length() if d.is_static else None for d in port.get_partial_shape())
    return TensorSpec(name, _dtype(port.get_element_type()), shape)


def compile_config(options: SessionOptions) -> dict[str, object]:
    """The compile properties for ``options``; pure, so it is tested without a device."""
    config: dict[str, object] = {"PERFORMANCE_HINT": str(options.extra.get("performance_hint", "LATENCY"))}
    if options.precision == "int8":
        # INT8 comes from the quantized model itself (NNCF); keep the rest of the graph at f32.
        config["INFERENCE_PRECISION_HINT"] = "f32"
    else:
        config["INFERENCE_PRECISION_HINT"] = _PRECISION_HINT[options.precision]
    on_npu = npu.is_npu(options.device)
    if options.threads and not on_npu:
        config["INFERENCE_NUM_THREADS"] = str(options.threads)
    if options.cache_dir and not (on_npu and not npu.blob_cache_exact()):
        # The first NPU compile takes minutes; CACHE_DIR turns later ones into a blob import.
        config["CACHE_DIR"] = str(Path(options.cache_dir) / "openvino")
    if on_npu:
        llm = options.extra.get("npu_llm")
        config.update(npu.compile_properties(llm if isinstance(llm, npu.LlmShape) else None))
    return config


class OvSession:
    """An OpenVINO compiled model and its infer request behind the ``Session`` interface."""

    backend = "openvino"

    def __init__(self, model: ov.Model, compiled: ov.CompiledModel, path: Path, device: str) -> None:
        self.path = path
        self.device = device
        self.stateful = bool(model.get_sinks())  # the KV cache lives in the request (see the module doc)
        self.npu_llm: npu.LlmShape | None = None  # what the NPU's LLM mode compiled (prompt length, capacity)
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        # Names come from the model as read: compilation can merge tensor names, and a merged
        # port's get_any_name() may then return an internal one ("/Concat_output_0").
        self.inputs = tuple(_spec(p, f"input_{i}") for i, p in enumerate(model.inputs))
        self.outputs = tuple(_spec(p, f"output_{i}") for i, p in enumerate(model.outputs))
        self._in_index = {s.name: i for i, s in enumerate(self.inputs)}
        self._out_index = {s.name: i for i, s in enumerate(self.outputs)}

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds)
        try:
            # The caller's arrays are read in place (share_inputs) and the outputs copied once, below
            # (share_outputs): the request reuses its output tensors on the next infer().
            results = self._request.infer(
                {self._in_index[name]: value for name, value in feeds.items()}, share_inputs=True, share_outputs=True
            )
        except Exception as exc:
            text = str(exc).strip().splitlines()
            msg = text[-1] if text else type(exc).__name__
            raise InputError(f"openvino rejected the inputs for {self.path.name}: {msg}") from exc
        names = list(output_names) if output_names is not None else list(self._out_index)
        out = {}
        for name in names:
            if name not in self._out_index:
                raise InputError(f"unknown output {name!r}; the model has {list(self._out_index)}")
            out[name] = np.array(results[self._out_index[name]], copy=True)
        return out

    def reset_state(self) -> None:
        """Forget what a stateful model holds (its KV cache): the next run starts a new sequence."""
        self._request.reset_state()

    def close(self) -> None:
        self._request = None
        self._compiled = None


def open(path: Path, options: SessionOptions) -> OvSession:
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    if path.suffix not in (".onnx", ".xml"):
        raise ModelError(f"{path}: OpenVINO reads .onnx or IR .xml files")
    device = options.device.upper()
    base = device.split(":")[0].split(".")[0]
    if base not in ("CPU", "GPU", "NPU", "AUTO", "HETERO", "MULTI"):
        raise BackendError(f"openvino: unknown device {options.device!r}; use CPU, GPU, NPU or AUTO")
    core = ov.Core()
    available = core.available_devices
    present = npu.present(available) if base == "NPU" else any(d.startswith(base) for d in available)
    if base not in ("AUTO", "HETERO", "MULTI") and not present:
        hint = " (the NPU needs the intel-npu driver: /dev/accel/accel0)" if base == "NPU" else ""
        raise DeviceUnavailable(f"openvino: device {device} is not present{hint}; this machine has {available}")
    try:
        model = core.read_model(str(path))
    except Exception as exc:
        raise EngineError(f"{path} is not a readable model (corrupt or truncated?): {str(exc).strip()[:300]}") from exc
    if options.static_shapes:
        model.reshape({name: ov.PartialShape(list(shape)) for name, shape in options.static_shapes.items()})
    llm_mode = base == "NPU" and isinstance(options.extra.get("npu_llm"), npu.LlmShape)
    if llm_mode and not model.get_sinks():
        # A plain decoder export: made stateful here (a built intel-npu engine is stateful already).
        from .openvino_stateful import make_stateful

        window = options.extra.get("sliding_window")
        shape = options.extra["npu_llm"]
        assert isinstance(shape, npu.LlmShape)
        done = make_stateful(model, window if isinstance(window, int) else None, shape.capacity)
        log.info("%s made stateful for the NPU's LLM mode: %s", path.name, done)
    if base == "NPU" and model.is_dynamic() and not llm_mode:  # the LLM mode fixes the shapes itself
        dynamic = [p.get_any_name() for p in model.inputs if p.get_partial_shape().is_dynamic]
        raise InputError(
            f"the NPU compiles static shapes only; give static shapes for {dynamic} "
            "(the engine recipe's fixed shape profile)"
        )
    try:
        compiled = core.compile_model(model, device, compile_config(options))
    except Exception as exc:
        raise BackendError(f"openvino failed to compile {path} for {device}: {str(exc).strip()[:300]}") from exc
    emulated = " (emulated on the CPU)" if base == "NPU" and npu.emulation() != "off" else ""
    log.debug("openvino compiled %s for %s%s", path, device, emulated)
    session = OvSession(model, compiled, path, device)
    session.npu_llm = options.extra.get("npu_llm") if llm_mode else None  # type: ignore[assignment]
    return session
