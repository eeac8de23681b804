"""What an engine is specific to: the runtime version and the device (parts of the cache key).

- cpu: architecture, CPU model name and the ISA features that change kernels (AVX2, AVX-512,
  VNNI, AMX): an ONNX Runtime or OpenVINO model optimized on one CPU may pick kernels another lacks.
- jetson: GPU name + compute capability + JetPack/L4T release (TensorRT plans are tied to all three).
- intel-npu: the NPU driver version (compiled blobs follow the driver).

Versions are read without importing heavy runtimes where a distribution's metadata suffices,
and TensorRT is probed in a subprocess (its import can crash a machine without a working GPU).
"""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

_ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
)
_DISTRIBUTIONS = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino"),
    "openvino": ("openvino",),
}


def cpu_fingerprint(cpuinfo: str | None = None, machine: str | None = None) -> str:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not name:
            name = " ".join(value.split())
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    isa = ",".join(f for f in _ISA_FLAGS if f in flags)
    return f"cpu:{machine or platform.machine()}:{name or 'unknown'}:{isa}"


def jetson_fingerprint(gpu_name: str, compute_capability: tuple[int, int], l4t: str | None = None) -> str:
    if l4t is None:
        try:
            l4t = Path("/etc/nv_tegra_release").read_text().splitlines()[0].strip()
        except (OSError, IndexError):
            l4t = "no-l4t"
    return f"cuda:{gpu_name}:sm_{compute_capability[0]}{compute_capability[1]}:{l4t}"


def npu_fingerprint() -> str:
    from ..backends.npu import emulation

    if emulation() != "off":  # an emulated NPU's blobs are never served on silicon, nor the other way
        return f"npu:emulated-{emulation()}:{cpu_fingerprint()}"
    try:
        import openvino as ov

        core = ov.Core()
        if "NPU" in core.available_devices:
            return f"npu:{core.get_property('NPU', 'FULL_DEVICE_NAME')}:{core.get_property('NPU', 'DRIVER_VERSION')}"
    except Exception:  # no openvino, or a plugin that fails to load without its driver
        pass
    return "npu:absent"


def device_fingerprint(target: str) -> str:
    if target == "cpu":
        return cpu_fingerprint()
    if target == "intel-npu":
        return npu_fingerprint()
    if target == "jetson":
        from ..backends.cuda import select_cuda

        try:
            cuda = select_cuda(None, 0)
            return jetson_fingerprint(cuda.device_name(0), cuda.compute_capability(0))
        except Exception as exc:  # no GPU: the key still differs from any real device's
            return f"cuda:absent:{type(exc).__name__}"
    raise ValueError(f"unknown target {target!r}")


def runtime_version(backend: str) -> str | None:
    """The installed version of ``backend``'s runtime, or None when it is not installed."""
    if backend == "tensorrt":
        from ..backends.tensorrt import probe_tensorrt

        return probe_tensorrt().get("version")
    for dist in _DISTRIBUTIONS.get(backend, (backend,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def runtime_versions() -> dict[str, str | None]:
    return {b: runtime_version(b) for b in ("onnxruntime", "openvino", "tensorrt")}
