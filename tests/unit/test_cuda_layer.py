"""The CUDA layer's selection and error mapping, with no GPU: real cuda-python, stand-ins for the rest."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import cuda as cuda_layer
from edge_agent.errors import BackendError, BackendUnavailable, DeviceUnavailable
from tests.fakes.fake_cuda import FakeCuda

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json
from edge_agent.backends.cuda import select_cuda
try:
    c = select_cuda("cuda-python")
    print(json.dumps({"count": c.device_count()}))
except Exception as exc:
    print(json.dumps({"kind": type(exc).__name__, "message": str(exc)}))
"""


def test_real_cuda_python_without_a_gpu_is_device_unavailable() -> None:
    pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed")
    # A child process: whatever the driver does, this test process stays up.
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "count" in result:
        pytest.skip(f"this machine has {result['count']} CUDA device(s); the no-GPU path is not reachable")
    assert result["kind"] == "DeviceUnavailable"
    assert "cudaErrorInsufficientDriver" in result["message"] or "cudaErrorNoDevice" in result["message"]


class _StubRuntime:
    """The cuda-python call convention (``(err, *values)``) with the real enums; one device."""

    def __init__(self, rt: types.ModuleType, count: int = 1, malloc_error: str | None = None) -> None:
        self.cudaError_t, self.cudaMemcpyKind = rt.cudaError_t, rt.cudaMemcpyKind
        self.cudaDeviceAttr = rt.cudaDeviceAttr
        self._ok, self._count, self._malloc_error = rt.cudaError_t.cudaSuccess, count, malloc_error
        self.calls: list[str] = []

    def cudaGetDeviceCount(self):
        if self._count == 0:
            return (self.cudaError_t.cudaErrorNoDevice, 0)
        return (self._ok, self._count)

    def cudaSetDevice(self, device):
        return (self._ok,)

    def cudaMalloc(self, nbytes):
        if self._malloc_error:
            return (getattr(self.cudaError_t, self._malloc_error), None)
        return (self._ok, 0x1000)

    def cudaMemcpyAsync(self, *args):
        self.calls.append("cudaMemcpyAsync")
        return (self._ok,)


@pytest.fixture
def real_rt() -> types.ModuleType:
    return pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed")


def test_no_device_error_names_the_cuda_error(real_rt, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_layer, "_import_cuda_python", lambda failures: _StubRuntime(real_rt, count=0))
    with pytest.raises(DeviceUnavailable, match="cudaErrorNoDevice"):
        cuda_layer.select_cuda()


def test_every_cuda_call_is_checked(real_rt, monkeypatch: pytest.MonkeyPatch) -> None:
    stub = _StubRuntime(real_rt, malloc_error="cudaErrorMemoryAllocation")
    monkeypatch.setattr(cuda_layer, "_import_cuda_python", lambda failures: stub)
    cuda = cuda_layer.select_cuda()
    assert cuda.api == "cuda-python"
    with pytest.raises(BackendError, match=r"cudaMalloc failed: cudaErrorMemoryAllocation \(2\)"):
        cuda.malloc(1 << 40)


def test_oversized_copy_is_refused_before_reaching_cuda(real_rt, monkeypatch: pytest.MonkeyPatch) -> None:
    stub = _StubRuntime(real_rt)
    monkeypatch.setattr(cuda_layer, "_import_cuda_python", lambda failures: stub)
    cuda = cuda_layer.select_cuda("cuda-python")
    buffer = cuda.malloc(16)
    stream = cuda_layer.Stream(None, 0, lambda: None, lambda: None)
    with pytest.raises(BackendError, match="does not fit a 16-byte buffer"):
        cuda.copy_htod_async(buffer, np.zeros(8, dtype=np.float32), stream)
    assert stub.calls == []
    cuda.copy_htod_async(buffer, np.zeros(4, dtype=np.float32), stream)
    assert stub.calls == ["cudaMemcpyAsync"]


def test_pycuda_missing_is_backend_unavailable_with_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    with pytest.raises(BackendUnavailable) as err:
        cuda_layer.select_cuda("pycuda")
    assert "pycuda" in str(err.value) and "pip install" in str(err.value)


def test_neither_api_importable_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("cuda.bindings.runtime", "cuda.cudart", "pycuda", "pycuda.driver"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailable, match=r"edge-agent\[tensorrt\]"):
        cuda_layer.select_cuda()


def test_pycuda_without_a_device_is_device_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = types.ModuleType("pycuda.driver")

    class Error(Exception):
        pass

    def init() -> None:
        raise Error("cuInit failed: no CUDA-capable device is detected")

    driver.Error, driver.init = Error, init
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    with pytest.raises(DeviceUnavailable, match="no CUDA-capable device"):
        cuda_layer.select_cuda("pycuda")


def test_unknown_api_name_is_rejected() -> None:
    with pytest.raises(BackendError, match="unknown CUDA API"):
        cuda_layer.select_cuda("opencl")


def test_device_buffer_free_is_idempotent() -> None:
    freed: list[int] = []
    buffer = cuda_layer.DeviceBuffer(0x10, 4, freed.append)
    buffer.free()
    buffer.free()
    assert freed == [0x10]


def test_fake_cuda_copies_are_real_bytes() -> None:
    cuda = FakeCuda()
    stream = cuda.stream()
    buffer = cuda.malloc(64)
    src = np.arange(16, dtype=np.float32)
    dst = np.zeros(16, dtype=np.float32)
    cuda.copy_htod_async(buffer, src, stream)
    cuda.copy_dtoh_async(dst, buffer, stream)
    np.testing.assert_array_equal(dst, src)
    buffer.free()
    assert cuda.live == {}
