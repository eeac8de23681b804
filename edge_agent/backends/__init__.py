"""Inference backends: the one seam between the agent and a runtime.

A backend only runs tensors: ``Session.run(feeds) -> outputs`` plus the input/output specs and
``close()``. KV caches, tokenizers and audio state live in the model adapters above it.

Backends are imported lazily: ``open_session`` imports only the runtime it is asked for, and a
missing runtime raises ``BackendUnavailable`` naming the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from ..errors import BackendError, BackendUnavailable, InputError, ModelError

log = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "fp16", "bf16", "int8"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output. ``shape`` holds ints for fixed dims, names (or None) for dynamic ones."""

    name: str
    dtype: str  # numpy dtype name: "float32", "int64", ...
    shape: tuple[int | str | None, ...]

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) and d >= 0 for d in self.shape)


@dataclass(frozen=True, slots=True)
class SessionOptions:
    """What every backend understands. Backend-specific knobs go in ``extra``."""

    device: str = "cpu"  # cpu | cuda | tensorrt | GPU | NPU | AUTO (backend decides what it accepts)
    precision: Precision = "auto"  # "auto" = the model's own precision, never a silent downcast
    threads: int = 0  # intra-op threads; 0 = runtime default
    cache_dir: Path | None = None  # compiled-model / engine caches
    static_shapes: Mapping[str, tuple[int, ...]] | None = None  # required for the NPU
    extra: Mapping[str, object] = field(default_factory=dict)


@runtime_checkable
class Session(Protocol):
    """A loaded model on one device. Not thread-safe: the agent calls it from one device thread."""

    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run once. Returns the requested outputs (all when None) as numpy arrays the caller owns."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class BindingSession(Session, Protocol):
    """A session that can run into buffers the caller owns (ONNX Runtime's I/O binding): in-place KV caches."""

    def run_with_binding(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None: ...

    def prepare_binding(self, fixed_in: Mapping[str, np.ndarray], fixed_out: Mapping[str, np.ndarray]) -> PreparedRun:
        """A binding with ``fixed_in`` / ``fixed_out`` bound once (buffers the caller keeps alive and in place,
        e.g. KV slots): each ``PreparedRun.run`` binds only the rest."""
        ...


def optional_inputs(session: Session) -> frozenset[str]:
    """Inputs ``session`` takes but has a default for (ONNX Runtime: initializers listed as graph inputs, such
    as an imported decoder's ``logits_to_keep``); other backends fold such defaults into constants."""
    return frozenset(s.name for s in getattr(session, "optional_inputs", ()))


def last_position_only(session: Session) -> bool:
    """Whether ``session``'s ``logits`` hold one position per sequence whatever it is fed (their position dim is
    fixed at 1): a TensorRT engine of a decoder with ``logits_to_keep``, built to keep the last position. What
    needs every position's logits feeds such a session one token a call."""
    spec = next((s for s in session.outputs if s.name == "logits"), None)
    return spec is not None and len(spec.shape) == 3 and spec.shape[1] == 1


def is_stateful(session: Session) -> bool:
    """Whether ``session`` keeps a model's state (an LLM's KV cache) in the runtime, with ``reset_state()``
    to start a new sequence: OpenVINO's stateful IRs, which the NPU's LLM mode runs."""
    return bool(getattr(session, "stateful", False)) and hasattr(session, "reset_state")


class PreparedRun(Protocol):
    """Runs of one session into buffers bound once; ``run`` binds the inputs and outputs that change."""

    def run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None: ...


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """A backend the registry knows: the module that implements it, the package it needs, how to install it."""

    name: str
    module: str  # imported lazily
    requires: str  # top-level Python package the backend needs
    install_hint: str


BACKENDS: dict[str, BackendInfo] = {
    "onnxruntime": BackendInfo(
        "onnxruntime",
        "edge_agent.backends.onnxruntime",
        "onnxruntime",
        "pip install onnxruntime (or onnxruntime-gpu on CUDA machines; never both)",
    ),
    "openvino": BackendInfo(
        "openvino",
        "edge_agent.backends.openvino",
        "openvino",
        "pip install 'edge-agent[openvino]'",
    ),
    "tensorrt": BackendInfo(
        "tensorrt",
        "edge_agent.backends.tensorrt",
        "tensorrt",
        "TensorRT comes from JetPack (apt install python3-libnvinfer) and needs "
        "pip install 'edge-agent[tensorrt]' (cuda-python) or pycuda",
    ),
    "fake": BackendInfo("fake", "edge_agent.backends.fake", "numpy", "(built in)"),
}


def backend_names() -> list[str]:
    return list(BACKENDS)


def is_installed(backend: str) -> bool:
    """Whether the backend's Python package can be imported (without importing it)."""
    info = _info(backend)
    return importlib.util.find_spec(info.requires) is not None


def _info(backend: str) -> BackendInfo:
    try:
        return BACKENDS[backend]
    except KeyError:
        raise BackendError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}") from None


def open_session(
    model_path: str | Path,
    backend: str = "onnxruntime",
    options: SessionOptions | None = None,
    warmup: Mapping[str, np.ndarray] | Callable[[Session], None] | None = None,
) -> Session:
    """Open ``model_path`` on ``backend`` and warm it up.

    ``warmup`` is either feeds to run once, or a callable that exercises the session (model
    adapters pass one that runs a real prefill and decode step). When omitted, a generic
    warm-up runs with every dynamic dimension set to 1 where the model accepts that.
    """
    info = _info(backend)
    if not is_installed(backend):
        raise BackendUnavailable(f"backend {backend!r} needs the {info.requires!r} package: {info.install_hint}")
    try:
        module = importlib.import_module(info.module)
    except ImportError as exc:  # installed but broken (e.g. a missing shared library)
        raise BackendUnavailable(f"backend {backend!r} failed to import: {exc}. {info.install_hint}") from exc
    check_fits_memory(Path(model_path))
    session: Session = module.open(Path(model_path), options or SessionOptions())
    start = time.perf_counter()
    try:
        if callable(warmup):
            warmup(session)
        elif warmup is not None:
            session.run(warmup)
        else:
            _generic_warmup(session)
    except Exception:
        session.close()
        raise
    log.debug("%s warm-up of %s took %.1f ms", backend, model_path, (time.perf_counter() - start) * 1e3)
    return session


def weight_bytes(model_path: Path) -> int:
    """The bytes of a model file and the weights stored beside it (ONNX external data, an OpenVINO .bin)."""
    files = [model_path, model_path.with_name(model_path.name + ".data"), model_path.with_suffix(".bin")]
    return sum(f.stat().st_size for f in files if f.is_file())


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_memory(model_path: Path, available: int | None = None) -> None:
    """Refuse, before loading, a model whose weights alone exceed the memory this machine has free: a
    runtime would otherwise allocate until the kernel's OOM killer ends the daemon (Jetson's GPU shares it)."""
    need = weight_bytes(model_path)
    free = available_memory_bytes() if available is None else available
    if free is not None and need > free:
        raise ModelError(
            f"{model_path}: its weights need {need / 2**20:,.0f} MiB of memory and this machine has "
            f"{free / 2**20:,.0f} MiB available: serve a smaller model or a quantized engine of it "
            "(edge-agent build --precision int8w|int4)"
        )


def dummy_feeds(
    specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None, default: int = 1
) -> dict[str, np.ndarray]:
    """Zero-filled feeds for ``specs``; named dynamic dims come from ``dims``, others are ``default``."""
    dims = dims or {}
    feeds = {}
    for spec in specs:
        shape = tuple(d if isinstance(d, int) and d >= 0 else dims.get(str(d), default) for d in spec.shape)
        feeds[spec.name] = np.zeros(shape, dtype=np.dtype(spec.dtype))
    return feeds


def _generic_warmup(session: Session) -> None:
    # Engines with optimization profiles know the smallest shapes they accept (often above 1).
    make = getattr(session, "warmup_feeds", None)
    feeds = make() if callable(make) else dummy_feeds(session.inputs)
    try:
        session.run(feeds)
    except (InputError, BackendError) as exc:
        # A guess of 1 for every dynamic dim does not suit every model (tied dims such as
        # attention_mask = past + seq, a minimum audio length): their adapters warm up for real.
        log.debug("generic warm-up skipped for %s: %s", getattr(session, "path", "this model"), exc)


def check_feeds(
    specs: Sequence[TensorSpec],
    feeds: Mapping[str, np.ndarray],
    complete: bool = True,
    optional: Sequence[TensorSpec] = (),
) -> None:
    """Reject feeds with unknown or missing names (``complete``: every input of ``specs`` must be there; those
    of ``optional`` may be left out), wrong dtypes or ranks, or wrong fixed dims."""
    by_name = {s.name: s for s in (*specs, *optional)}
    unknown = [n for n in feeds if n not in by_name]
    if unknown:
        raise InputError(f"unknown input(s) {unknown}; the model takes {sorted(by_name)}")
    missing = [s.name for s in specs if s.name not in feeds] if complete else []
    if missing:
        raise InputError(f"missing input(s) {missing}")
    for name, value in feeds.items():
        spec = by_name[name]
        if not isinstance(value, np.ndarray):
            raise InputError(f"input {name!r}: expected a numpy array, got {type(value).__name__}")
        if value.dtype != np.dtype(spec.dtype):
            raise InputError(f"input {name!r}: dtype {value.dtype} but the model wants {spec.dtype}")
        if value.ndim != len(spec.shape):
            raise InputError(f"input {name!r}: rank {value.ndim} {value.shape} but the model wants {spec.shape}")
        for axis, (got, want) in enumerate(zip(value.shape, spec.shape)):
            if isinstance(want, int) and want >= 0 and got != want:
                raise InputError(f"input {name!r}: dim {axis} is {got} but the model fixes it at {want}")
