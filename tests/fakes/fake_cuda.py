"""A CUDA layer for tests: "device memory" is host bytearrays keyed by fake pointers, so copies are real.

``HEAP`` is shared with ``fake_tensorrt``, whose execution context reads inputs from and writes
outputs to the addresses given to ``set_tensor_address``, as a real engine does on the GPU.
Everything runs synchronously; streams and events keep the real call shapes and checks.
"""

from __future__ import annotations

import time

import numpy as np

from edge_agent.backends.cuda import DeviceBuffer, Event, Stream
from edge_agent.errors import BackendError

_ALIGN = 256  # cudaMalloc alignment


class FakeHeap:
    def __init__(self) -> None:
        self.blocks: dict[int, bytearray] = {}
        self._next = 0x7F00_0000_0000

    def alloc(self, nbytes: int) -> int:
        ptr = self._next
        self.blocks[ptr] = bytearray(nbytes)
        self._next += max(nbytes, 1) + _ALIGN - max(nbytes, 1) % _ALIGN
        return ptr

    def free(self, ptr: int) -> None:
        if ptr not in self.blocks:
            raise BackendError(f"CUDA cudaFree failed: cudaErrorInvalidValue (1) for pointer {ptr:#x}")
        del self.blocks[ptr]

    def view(self, ptr: int, nbytes: int) -> memoryview:
        """``nbytes`` at ``ptr``, which may point inside an allocation; out of bounds is an error."""
        for base, block in self.blocks.items():
            if base <= ptr and ptr + nbytes <= base + len(block):
                return memoryview(block)[ptr - base : ptr - base + nbytes]
        raise BackendError(f"illegal address: {nbytes} bytes at {ptr:#x} are not inside one allocation")


HEAP = FakeHeap()


class FakeCuda:
    """Implements ``edge_agent.backends.cuda.Cuda``; counts calls so tests can assert on them."""

    api = "fake"

    def __init__(self, name: str = "Fake Orin", capability: tuple[int, int] = (8, 7)) -> None:
        self.device = 0
        self._name, self._cc = name, capability
        self.malloc_calls = 0
        self.live: dict[int, int] = {}  # ptr -> nbytes of buffers not yet freed
        self.pinned_live = 0
        self.streams_open = 0
        self.events_open = 0
        self._handles = 0x5000

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int) -> str:
        return self._name

    def compute_capability(self, index: int) -> tuple[int, int]:
        return self._cc

    def stream(self) -> Stream:
        self._handles += 16
        self.streams_open += 1

        def destroy() -> None:
            self.streams_open -= 1

        return Stream(object(), self._handles, lambda: None, destroy)

    def malloc(self, nbytes: int) -> DeviceBuffer:
        self.malloc_calls += 1
        ptr = HEAP.alloc(max(int(nbytes), 1))
        self.live[ptr] = int(nbytes)

        def release(p: int) -> None:
            HEAP.free(p)
            del self.live[p]

        return DeviceBuffer(ptr, int(nbytes), release)

    def pinned(self, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        self.pinned_live += 1
        return np.empty(shape, dtype=np.dtype(dtype))

    def free_pinned(self, array: np.ndarray) -> None:
        self.pinned_live -= 1

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None:
        _check(src.nbytes, dst.nbytes, src)
        HEAP.view(dst.ptr, src.nbytes)[:] = src.tobytes()

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None:
        _check(dst.nbytes, src.nbytes, dst)
        dst.reshape(-1).view(np.uint8)[:] = np.frombuffer(HEAP.view(src.ptr, dst.nbytes), dtype=np.uint8)

    def event(self) -> Event:
        self.events_open += 1

        def destroy() -> None:
            self.events_open -= 1

        return Event([None], destroy)

    def record(self, event: Event, stream: Stream) -> None:
        event.native[0] = time.perf_counter()

    def elapsed_ms(self, start: Event, end: Event) -> float:
        if start.native[0] is None or end.native[0] is None:
            raise BackendError("CUDA cudaEventElapsedTime failed: cudaErrorInvalidResourceHandle (400)")
        return (end.native[0] - start.native[0]) * 1e3


def _check(copy_nbytes: int, buffer_nbytes: int, host: np.ndarray) -> None:
    if copy_nbytes > buffer_nbytes:
        raise BackendError(f"copy of {copy_nbytes} bytes does not fit a {buffer_nbytes}-byte buffer")
    if not host.flags.c_contiguous:
        raise BackendError("async copies need a contiguous host array")
