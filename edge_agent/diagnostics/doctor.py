"""``edge-agent doctor``: what runtimes, devices and versions this machine has.

Anything that loads a GPU, NPU or audio driver, or TensorRT, runs in a child Python with a timeout
(a TensorRT import or deserialize without a working GPU can segfault); cheap file reads run here.
A probe that crashes, hangs or raises becomes an ``error`` entry; ``collect`` itself never raises.

Every section is ``{status: ok | absent | error, version, detail, data, warnings}``: ``absent``
means not installed or no such hardware (with what to install), ``error`` means it is there but broken.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..backends import npu as npu_backend
from ..backends.probe import run_probe

if TYPE_CHECKING:
    from ..config import Settings

SECTIONS = ("system", "python", "jetson", "cuda", "tensorrt", "openvino", "onnxruntime", "audio", "build")


@dataclass(slots=True)
class Entry:
    """One section of the doctor's report: ok, absent (with what to install) or error, and what was found."""

    status: Literal["ok", "absent", "error"]
    version: str | None = None
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def collect(timeout_s: float = 20, config: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Every section of ``SECTIONS``, probed in parallel; each child gets ``timeout_s``. ``config`` (else
    the default file, and the environment) adds what the agent's own settings make of this machine."""
    settings = _settings(config)  # loading it also puts its NPU emulation in the environment the probes inherit
    probes: dict[str, Callable[[float], Entry]] = {
        "system": _system,
        "python": _python,
        "jetson": _jetson,
        "cuda": _cuda,
        "tensorrt": _tensorrt,
        "openvino": _openvino,
        "onnxruntime": _onnxruntime,
        "audio": _audio,
        "build": _build,
    }
    with ThreadPoolExecutor(max_workers=len(probes)) as pool:
        futures = {name: pool.submit(_guarded, fn, timeout_s) for name, fn in probes.items()}
        report = {name: asdict(futures[name].result()) for name in SECTIONS}
    if settings is not None:
        report["system"]["warnings"] += _command_channel_warnings(settings)
        report["openvino"]["warnings"] += _prefix_cache_notes(settings)
    return report


def _settings(config: str | Path | None) -> Settings | None:
    """The agent's own settings (``config``, else the default file, plus the environment); None when they do
    not load, which is ``check-config``'s to report, not ours."""
    try:
        from ..config import load_settings

        return load_settings(config)
    except Exception:
        return None


def prefix_cache_notes(config: str | Path | None = None) -> list[str]:
    """The configured LLM tiers that run without the prefix KV cache (see ``_prefix_cache_notes``)."""
    settings = _settings(config)
    return _prefix_cache_notes(settings) if settings is not None else []


def _prefix_cache_notes(settings: Settings) -> list[str]:
    """A tier on the NPU keeps its KV cache inside the runtime (the plugin's LLM mode), where no cached
    prefix can be put."""
    from ..backends.npu import is_npu

    if not settings.prefix_cache.enabled:
        return []
    return [
        f"LLM tier {t.name!r} runs without the prefix cache: on the NPU its KV cache stays inside the runtime"
        for t in settings.models.llm
        if t.backend == "openvino" and is_npu(t.device)
    ]


def command_channel_warnings(config: str | Path | None = None) -> list[str]:
    """Can anyone on the agent's broker steer it (see ``_command_channel_warnings``)?"""
    settings = _settings(config)
    return _command_channel_warnings(settings) if settings is not None else []


def _command_channel_warnings(settings: Settings) -> list[str]:
    try:
        from ..telemetry.signing import command_channel_warnings as warnings_for

        return warnings_for(settings.mqtt, settings.telemetry)
    except Exception:  # a warning that cannot be worked out must not fail doctor
        return []


def _guarded(fn: Callable[[float], Entry], timeout_s: float) -> Entry:
    try:
        return fn(timeout_s)
    except Exception as exc:  # a bug in one probe must not hide the others
        return Entry("error", detail=f"probe failed: {type(exc).__name__}: {exc}")


def render_table(report: dict[str, dict[str, Any]]) -> str:
    rows = [("SECTION", "STATUS", "VERSION", "DETAIL")]
    rows += [(name, e.get("status", "?"), e.get("version") or "-", e.get("detail") or "") for name, e in report.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    warnings = [f"  {name}: {w}" for name, e in report.items() for w in e.get("warnings", [])]
    if warnings:
        lines += ["", "warnings:", *warnings]
    return "\n".join(line.rstrip() for line in lines)


# -- inline probes (file reads only) --------------------------------------------------------------


def _system(_: float) -> Entry:
    uname = platform.uname()
    try:
        os_name = platform.freedesktop_os_release().get("PRETTY_NAME", uname.system)
    except (OSError, AttributeError):
        os_name = f"{uname.system} {uname.release}"
    cpu = _first_field(_read("/proc/cpuinfo"), ("model name", "Model", "Hardware")) or uname.processor or "unknown CPU"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = {
        k: int(v.split()[0]) * 1024
        for k, v in _fields(_read("/proc/meminfo")).items()
        if k in ("MemTotal", "MemAvailable")
    }
    data = {
        "os": os_name,
        "kernel": uname.release,
        "arch": uname.machine,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": mem.get("MemTotal"),
        "memory_available_bytes": mem.get("MemAvailable"),
    }
    memory = f", {mem['MemTotal'] / 2**30:.1f} GiB RAM" if "MemTotal" in mem else ""
    detail = f"{os_name} {uname.machine}, {cpu}, {usable}/{os.cpu_count()} cores{memory}"
    return Entry("ok", uname.release, detail, data)


def _python(_: float) -> Entry:
    venv = sys.prefix != sys.base_prefix
    return Entry(
        "ok",
        platform.python_version(),
        f"{platform.python_implementation()} at {sys.executable}{' (virtualenv)' if venv else ''}",
        {"executable": sys.executable, "virtualenv": venv},
    )


def _jetson(timeout_s: float) -> Entry:
    release = _read("/etc/nv_tegra_release")
    model = _read("/proc/device-tree/model").strip("\0 \n")
    if not release and "jetson" not in model.lower():
        return Entry("absent", detail="not a Jetson (no /etc/nv_tegra_release)")
    l4t = None
    if release.startswith("# R"):  # "# R36 (release), REVISION: 4.0, GCID: ..."
        major = release[3:].split(" ", 1)[0]
        revision = release.split("REVISION:", 1)[1].split(",", 1)[0].strip() if "REVISION:" in release else "0"
        l4t = f"{major}.{revision}"
    jetpack = None
    if shutil.which("dpkg-query"):
        try:
            out = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", "nvidia-jetpack"],
                capture_output=True,
                text=True,
                timeout=min(timeout_s, 10),
            )
            if out.returncode == 0 and out.stdout.strip():
                jetpack = out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    detail = f"{model or 'Jetson'}, L4T {l4t or '?'}, JetPack {jetpack or 'unknown (nvidia-jetpack not installed)'}"
    return Entry("ok", jetpack or l4t, detail, {"model": model, "l4t": l4t, "jetpack": jetpack})


# -- child-process probes ---------------------------------------------------------------------------

_CUDA_CODE = """
import json
try:
    from edge_agent.backends.cuda import select_cuda
    c = select_cuda()
    out = {"api": c.api, "devices": [{"index": i, "name": c.device_name(i),
           "compute_capability": "%d.%d" % c.compute_capability(i)} for i in range(c.device_count())]}
    if c.api == "cuda-python":
        import importlib
        for mod in ("cuda.bindings.runtime", "cuda.cudart"):
            try:
                rt = importlib.import_module(mod)
                break
            except ImportError:
                pass
        v = rt.cudaDriverGetVersion()[1]
        out["driver"] = "%d.%d" % (v // 1000, v % 1000 // 10)
except Exception as exc:
    out = {"error_type": type(exc).__name__, "error": str(exc)}
print(json.dumps(out))
"""


def _cuda(timeout_s: float) -> Entry:
    versions = {d: _dist_version(d) for d in ("cuda-python", "cuda-bindings", "pycuda")}
    installed = {k: v for k, v in versions.items() if v}
    smi = _nvidia_smi(timeout_s)
    run = run_probe(_CUDA_CODE, timeout_s, "cuda")
    data: dict[str, Any] = {"packages": installed, "nvidia_smi": smi, **run.data}
    if run.error:
        return Entry("error", detail=run.error, data=data)
    version = installed.get("cuda-python") or installed.get("cuda-bindings") or installed.get("pycuda")
    if "devices" in run.data:
        devices = ", ".join(f"{d['name']} (sm {d['compute_capability']})" for d in run.data["devices"])
        driver = f", driver CUDA {run.data['driver']}" if run.data.get("driver") else ""
        return Entry("ok", version, f"{run.data['api']}: {devices}{driver}", data)
    entry = Entry("error", version, f"{run.data.get('error_type')}: {run.data.get('error')}", data)
    if run.data.get("error_type") in ("BackendUnavailable", "DeviceUnavailable"):
        entry.status = "absent"
        entry.detail = run.data["error"]
    if smi and smi.get("gpus") and entry.status != "ok":
        entry.warnings.append(
            f"nvidia-smi sees {len(smi['gpus'])} GPU(s) but CUDA from Python does not: {entry.detail}"
        )
    return entry


def _nvidia_smi(timeout_s: float) -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    if out.returncode != 0:
        return {"error": (out.stdout + out.stderr).strip()[-200:]}
    return {
        "gpus": [
            dict(zip(("name", "driver", "memory"), (p.strip() for p in line.split(","))))
            for line in out.stdout.splitlines()
            if line.strip()
        ]
    }


def _tensorrt(timeout_s: float) -> Entry:
    from ..backends.tensorrt import probe_tensorrt

    probe = probe_tensorrt(timeout_s)
    if not probe["installed"]:
        return Entry(
            "absent",
            detail="not installed: TensorRT comes from JetPack (apt install python3-libnvinfer), "
            "plus pip install 'edge-agent[tensorrt]'",
            data=probe,
        )
    if probe["error"]:
        return Entry("error", detail=f"import tensorrt failed: {probe['error']}", data=probe)
    major = (probe["version"] or "").split(".")[0]
    detail = "importable"
    if major.isdigit() and int(major) >= 11:
        detail += "; TensorRT 11+: strongly typed networks only, INT8 only from Q/DQ models (no calibrator)"
    return Entry("ok", probe["version"], detail, probe)


_OPENVINO_CODE = """
import json, openvino as ov
core = ov.Core()
devices = {}
for d in core.available_devices:
    try:
        devices[d] = str(core.get_property(d, "FULL_DEVICE_NAME"))
    except Exception as exc:
        devices[d] = "? (%s)" % exc
npu_driver = None
if "NPU" in devices:
    try:
        npu_driver = str(core.get_property("NPU", "NPU_DRIVER_VERSION"))
    except Exception:
        pass
print(json.dumps({"version": getattr(ov, "__version__", None) or ov.get_version(), "devices": devices,
                  "npu_driver": npu_driver}))
"""


def _openvino(timeout_s: float) -> Entry:
    npu_nodes = sorted(glob.glob("/dev/accel/accel*"))
    if not _installed("openvino"):
        return Entry(
            "absent", detail="not installed: pip install 'edge-agent[openvino]'", data={"npu_nodes": npu_nodes}
        )
    run = run_probe(_OPENVINO_CODE, timeout_s, "openvino")
    emulation = npu_backend.emulation()
    data = {"npu_nodes": npu_nodes, "npu_emulation": emulation, **run.data}
    if run.error:
        return Entry("error", detail=run.error, data=data)
    devices: dict[str, str] = run.data.get("devices", {})
    npu = "NPU driver " + ("present" if npu_nodes else "absent (/dev/accel/accel* missing)")
    if emulation != "off":
        npu += f"; NPU emulated on the CPU (npu_emulation = {emulation})"
    entry = Entry(
        "ok",
        str(run.data.get("version")).split("-")[0],
        ", ".join(f"{d}: {n}" for d, n in devices.items()) + f"; {npu}",
        data,
    )
    if emulation != "off":
        entry.warnings.append(npu_backend.describe())
    if npu_nodes and "NPU" not in devices:
        entry.warnings.append(
            "an NPU device node exists but OpenVINO lists no NPU: install the NPU user-space "
            "driver (intel-npu-driver) and add this user to the 'render' group"
        )
    return entry


_ORT_CODE = """
import json, onnxruntime as ort
print(json.dumps({"version": ort.__version__, "providers": ort.get_available_providers()}))
"""


def _onnxruntime(timeout_s: float) -> Entry:
    if not _installed("onnxruntime"):
        return Entry("absent", detail="not installed: pip install onnxruntime")
    try:
        # Every onnxruntime-* wheel installs the same `onnxruntime` module; two of them overwrite each other.
        dists = sorted(set(importlib.metadata.packages_distributions().get("onnxruntime", [])))
    except Exception:
        dists = []
    run = run_probe(_ORT_CODE, timeout_s, "onnxruntime")
    data = {"distributions": dists, **run.data}
    entry = (
        Entry("error", detail=run.error, data=data)
        if run.error
        else Entry("ok", run.data.get("version"), "providers: " + ", ".join(run.data.get("providers", [])), data)
    )
    if len(dists) > 1:
        entry.warnings.append(
            f"{' and '.join(dists)} are all installed and replace each other's onnxruntime "
            f"module: uninstall them all, then install exactly one"
        )
    return entry


_AUDIO_CODE = """
import json, sounddevice as sd
inputs = [{"index": i, "name": d["name"], "channels": d["max_input_channels"],
           "default_samplerate": d["default_samplerate"]}
          for i, d in enumerate(sd.query_devices()) if d["max_input_channels"] > 0]
print(json.dumps({"version": sd.__version__, "portaudio": sd.get_portaudio_version()[1], "inputs": inputs}))
"""


def _audio(timeout_s: float) -> Entry:
    if not _installed("sounddevice"):
        return Entry("absent", detail="not installed: pip install 'edge-agent[audio]'")
    run = run_probe(_AUDIO_CODE, timeout_s, "audio")
    if run.error:
        hint = "; install PortAudio: apt install libportaudio2" if "PortAudio" in run.error else ""
        return Entry("error", detail=run.error + hint)
    inputs = run.data.get("inputs", [])
    entry = Entry(
        "ok",
        run.data.get("version"),
        f"{len(inputs)} input device(s)" + (": " + ", ".join(d["name"] for d in inputs[:4]) if inputs else ""),
        run.data,
    )
    if not inputs:
        entry.warnings.append("no audio input device: the microphone source cannot start (wav replay still works)")
    return entry


def _build(_: float) -> Entry:
    """Engine building (``edge-agent build`` and the daemon's background builds): available or why not."""
    from ..engines.recipes import recipe_dirs, recipe_files
    from ..engines.synth_audio import missing_tools
    from ..shipped import default_recipes_dir

    tools = {d: _dist_version(d) for d in ("onnx", "nncf")}
    recipes = recipe_files(default_recipes_dir())
    data = {
        "packages": tools,
        "recipe_dirs": [str(d) for d in recipe_dirs(default_recipes_dir())],
        "recipes": [p.stem for p in recipes],
        "synth_tools_missing": missing_tools(),
    }
    if not tools["onnx"] or not _installed("onnx"):
        return Entry(
            "absent",
            detail="engine building unavailable: the onnx package is missing (pip install "
            "'edge-agent[build]'); `edge-agent run` serves model folders and builds no engines",
            data=data,
        )
    runtimes = ["ONNX Runtime (INT8, FP16)"]
    entry = Entry("ok", tools["onnx"], "", data)
    if _installed("openvino"):
        if tools["nncf"] and _installed("nncf"):
            runtimes.append("OpenVINO (NNCF INT8, INT4/INT8 weights, FP16)")
        else:
            runtimes.append("OpenVINO (FP16 only)")
            entry.warnings.append("OpenVINO INT8/INT4 engines need nncf: pip install 'edge-agent[build]'")
    if _installed("tensorrt"):
        runtimes.append("TensorRT")
    entry.detail = f"engine building available for {', '.join(runtimes)}; {len(recipes)} recipe(s) in " + " then ".join(
        data["recipe_dirs"]
    )
    if data["synth_tools_missing"]:
        entry.warnings.append(
            f"{' and '.join(data['synth_tools_missing'])} missing: the shipped ASR calibration "
            "audio cannot be synthesised (apt install espeak-ng sox), so ASR INT8 builds fail"
        )
    return entry


# -- helpers ----------------------------------------------------------------------------------------


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _fields(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def _first_field(text: str, keys: tuple[str, ...]) -> str | None:
    fields = _fields(text)
    return next((fields[k] for k in keys if fields.get(k)), None)
