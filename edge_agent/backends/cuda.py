"""CUDA device memory, streams and events behind one small interface.

Two implementations, chosen by ``select_cuda``:

* cuda-python (``cuda.bindings.runtime``; ``cuda.cudart`` on cuda-python < 12.6), what NVIDIA's
  TensorRT samples use since TensorRT 10.14 and what ``pip install 'edge-agent[tensorrt]'`` brings;
* pycuda (``pycuda.driver``), what most JetPack 6 images ship.

Both speak the CUDA *primary* context, the one the CUDA runtime and therefore TensorRT use, so
pointers and streams from either are valid for ``IExecutionContext.execute_async_v3``.

Errors: an import failure is ``BackendUnavailable`` (names what to install), no usable device is
``DeviceUnavailable``, any other failed CUDA call is ``BackendError`` naming the CUDA error.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from ..errors import BackendError, BackendUnavailable, DeviceUnavailable

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'edge-agent[tensorrt]' (cuda-python), or use JetPack's pycuda (pip install pycuda)"


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr``. ``free()`` is idempotent."""

    __slots__ = ("ptr", "nbytes", "_release")

    def __init__(self, ptr: int, nbytes: int, release: Callable[[int], None]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self._release: Callable[[int], None] | None = release

    def free(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(self.ptr)


class Stream:
    """A CUDA stream. ``handle`` is the raw ``cudaStream_t`` as an int, what TensorRT takes."""

    __slots__ = ("handle", "native", "_sync", "_destroy")

    def __init__(self, native: Any, handle: int, sync: Callable[[], None], destroy: Callable[[], None]) -> None:
        self.native = native
        self.handle = handle
        self._sync = sync
        self._destroy: Callable[[], None] | None = destroy

    def synchronize(self) -> None:
        self._sync()

    def close(self) -> None:
        destroy, self._destroy = self._destroy, None
        if destroy is not None:
            destroy()


class Event:
    """A CUDA event for timing on the device, destroyed once by ``close``."""

    __slots__ = ("native", "_destroy")

    def __init__(self, native: Any, destroy: Callable[[], None]) -> None:
        self.native = native
        self._destroy: Callable[[], None] | None = destroy

    def close(self) -> None:
        destroy, self._destroy = self._destroy, None
        if destroy is not None:
            destroy()


class Cuda(Protocol):
    """What the TensorRT session needs from CUDA, and no more."""

    api: str  # "cuda-python" | "pycuda" (| "fake" in tests)

    def device_count(self) -> int: ...
    def device_name(self, index: int) -> str: ...
    def compute_capability(self, index: int) -> tuple[int, int]: ...
    def stream(self) -> Stream: ...
    def malloc(self, nbytes: int) -> DeviceBuffer: ...
    def pinned(self, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray: ...
    def free_pinned(self, array: np.ndarray) -> None: ...
    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None: ...
    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None: ...
    def event(self) -> Event: ...
    def record(self, event: Event, stream: Stream) -> None: ...
    def elapsed_ms(self, start: Event, end: Event) -> float: ...


def select_cuda(prefer: str | None = None, device: int = 0) -> Cuda:
    """The first CUDA API that imports (cuda-python, then pycuda), bound to ``device``.

    ``prefer`` = "cuda-python" or "pycuda" picks one and does not fall back to the other.
    """
    if prefer not in (None, "cuda-python", "pycuda"):
        raise BackendError(f"unknown CUDA API {prefer!r}; choose 'cuda-python' or 'pycuda'")
    failures: list[str] = []
    if prefer in (None, "cuda-python"):
        rt = _import_cuda_python(failures)
        if rt is not None:
            return _CudaPython(rt, device)
    if prefer in (None, "pycuda"):
        drv = _import_pycuda(failures)
        if drv is not None:
            return _PyCuda(drv, device)
    raise BackendUnavailable(f"no CUDA Python API is importable ({'; '.join(failures)}): {INSTALL_HINT}")


def _import_cuda_python(failures: list[str]) -> Any:
    # importlib rather than `from cuda.bindings import runtime`: the from-form returns an
    # attribute of an already-imported package and would ignore a blocked sys.modules entry.
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            last = exc
    failures.append(f"cuda-python: {last}")
    return None


def _import_pycuda(failures: list[str]) -> Any:
    try:
        return importlib.import_module("pycuda.driver")
    except ImportError as exc:  # also libcuda.so missing: pycuda links it at import time
        failures.append(f"pycuda: {exc}")
        return None


class _CudaPython:
    """cuda-python runtime API. Every call returns ``(err, *values)``; ``_call`` checks each one."""

    api = "cuda-python"

    def __init__(self, rt: Any, device: int) -> None:
        self._rt = rt
        self._pinned: dict[int, int] = {}  # id(array) -> host pointer
        err, count = rt.cudaGetDeviceCount()
        if err.value != 0:
            # 35 cudaErrorInsufficientDriver (no driver), 100 cudaErrorNoDevice, 34 stub library...
            raise DeviceUnavailable(f"no usable CUDA device: cudaGetDeviceCount failed with {_err_name(err)}")
        if not 0 <= device < count:
            raise DeviceUnavailable(f"CUDA device {device} requested but {count} device(s) present")
        self._call("cudaSetDevice", device)
        self.device = device

    def _call(self, fn: str, *args: Any) -> Any:
        result = getattr(self._rt, fn)(*args)
        err, values = result[0], result[1:]
        if err.value != 0:
            raise BackendError(f"CUDA {fn} failed: {_err_name(err)} ({err.value})")
        return values[0] if len(values) == 1 else (values or None)

    def device_count(self) -> int:
        return int(self._call("cudaGetDeviceCount"))

    def device_name(self, index: int) -> str:
        name = self._call("cudaGetDeviceProperties", index).name
        return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\0")

    def compute_capability(self, index: int) -> tuple[int, int]:
        attr = self._rt.cudaDeviceAttr
        major = self._call("cudaDeviceGetAttribute", attr.cudaDevAttrComputeCapabilityMajor, index)
        minor = self._call("cudaDeviceGetAttribute", attr.cudaDevAttrComputeCapabilityMinor, index)
        return int(major), int(minor)

    def stream(self) -> Stream:
        native = self._call("cudaStreamCreate")
        return Stream(
            native,
            int(native),
            lambda: self._call("cudaStreamSynchronize", native),
            lambda: self._call("cudaStreamDestroy", native),
        )

    def malloc(self, nbytes: int) -> DeviceBuffer:
        ptr = int(self._call("cudaMalloc", max(int(nbytes), 1)))
        return DeviceBuffer(ptr, int(nbytes), lambda p: self._call("cudaFree", p))

    def pinned(self, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * dt.itemsize, 1)
        ptr = int(self._call("cudaMallocHost", nbytes))
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        # a ctypes array is a buffer; numpy's stubs only list bytes-like types
        array = np.frombuffer(raw, dtype=np.uint8)[: nbytes - nbytes % dt.itemsize].view(dt).reshape(shape)  # type: ignore[call-overload]
        self._pinned[id(array)] = ptr
        return array

    def free_pinned(self, array: np.ndarray) -> None:
        ptr = self._pinned.pop(id(array), None)
        if ptr is not None:
            self._call("cudaFreeHost", ptr)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None:
        _check_fits(src.nbytes, dst.nbytes)
        self._call(
            "cudaMemcpyAsync",
            dst.ptr,
            src.ctypes.data,
            src.nbytes,
            self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            stream.native,
        )

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None:
        _check_fits(dst.nbytes, src.nbytes)
        self._call(
            "cudaMemcpyAsync",
            dst.ctypes.data,
            src.ptr,
            dst.nbytes,
            self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
            stream.native,
        )

    def event(self) -> Event:
        native = self._call("cudaEventCreate")
        return Event(native, lambda: self._call("cudaEventDestroy", native))

    def record(self, event: Event, stream: Stream) -> None:
        self._call("cudaEventRecord", event.native, stream.native)

    def elapsed_ms(self, start: Event, end: Event) -> float:
        self._call("cudaEventSynchronize", end.native)
        return float(self._call("cudaEventElapsedTime", start.native, end.native))


class _PyCuda:
    """pycuda without ``pycuda.autoinit``: the device's primary context, pushed around each call.

    Push/pop per call (microseconds) rather than once at start-up, because the agent may open a
    session on one thread (a background tier preload) and run it on another.
    """

    api = "pycuda"

    def __init__(self, drv: Any, device: int) -> None:
        self._drv = drv
        try:
            drv.init()
            count = drv.Device.count()
        except drv.Error as exc:  # "cuInit failed: no CUDA-capable device is detected", ...
            raise DeviceUnavailable(f"no usable CUDA device: {exc}") from exc
        if not 0 <= device < count:
            raise DeviceUnavailable(f"CUDA device {device} requested but {count} device(s) present")
        self.device = device
        self._context = drv.Device(device).retain_primary_context()

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        self._context.push()
        try:
            yield
        except self._drv.Error as exc:
            raise BackendError(f"CUDA (pycuda) call failed: {exc}") from exc
        finally:
            self._drv.Context.pop()

    def device_count(self) -> int:
        return int(self._drv.Device.count())

    def device_name(self, index: int) -> str:
        return str(self._drv.Device(index).name())

    def compute_capability(self, index: int) -> tuple[int, int]:
        major, minor = self._drv.Device(index).compute_capability()
        return int(major), int(minor)

    def stream(self) -> Stream:
        with self._current():
            native = self._drv.Stream()
        return Stream(native, int(native.handle), lambda: self._in_context(native.synchronize), lambda: None)

    def _in_context(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._current():
            return fn(*args)

    def malloc(self, nbytes: int) -> DeviceBuffer:
        with self._current():
            allocation = self._drv.mem_alloc(max(int(nbytes), 1))
        # Keep the DeviceAllocation alive in the closure: dropping it would free the memory.
        return DeviceBuffer(int(allocation), int(nbytes), lambda _ptr: self._in_context(allocation.free))

    def pinned(self, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        with self._current():
            return self._drv.pagelocked_empty(shape, np.dtype(dtype))

    def free_pinned(self, array: np.ndarray) -> None:
        base = getattr(array, "base", None)
        if base is not None and hasattr(base, "free"):  # pycuda's HostAllocation
            self._in_context(base.free)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None:
        _check_fits(src.nbytes, dst.nbytes)
        self._in_context(self._drv.memcpy_htod_async, dst.ptr, src, stream.native)

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None:
        _check_fits(dst.nbytes, src.nbytes)
        self._in_context(self._drv.memcpy_dtoh_async, dst, src.ptr, stream.native)

    def event(self) -> Event:
        with self._current():
            native = self._drv.Event()
        return Event(native, lambda: None)

    def record(self, event: Event, stream: Stream) -> None:
        self._in_context(event.native.record, stream.native)

    def elapsed_ms(self, start: Event, end: Event) -> float:
        with self._current():
            end.native.synchronize()
            return float(end.native.time_since(start.native))


def _err_name(err: Any) -> str:
    return str(getattr(err, "name", None) or err)


def _check_fits(copy_nbytes: int, buffer_nbytes: int) -> None:
    # An oversized async copy corrupts neighbouring allocations silently; refuse it here.
    if copy_nbytes > buffer_nbytes:
        raise BackendError(f"copy of {copy_nbytes} bytes does not fit a {buffer_nbytes}-byte buffer")
