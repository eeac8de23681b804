"""The device inventory that ``meta`` carries: host, accelerators, runtimes, and what each tier serves.

Three parts, merged by ``InventoryBook`` (the telemetry service republishes ``meta`` when it changes):
- ``host_inventory(root)``: OS, kernel, CPU, memory and the Jetson release files, read at once
  (cheap file reads under ``root``, so tests use a fake tree);
- ``from_doctor(report)``: the accelerator probes' findings (CUDA, TensorRT, OpenVINO devices, ONNX
  Runtime providers), from ``edge-agent doctor``'s report. The agent runs those probes in child
  processes on a thread after READY (a TensorRT probe can crash its process), and hands the report
  here: telemetry never imports the backends;
- the engines serving each tier, handed by the agent as plain dicts at start and on every switch.

``config_digest`` fingerprints the effective settings without their secrets, so a fleet can see
which devices run the same configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from .schema import Inventory

# Keys dropped before hashing, whatever their type: their values are credentials, not configuration.
SECRET_KEYS = frozenset({"password", "token", "secret", "key", "psk"})


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in sorted(value.items()) if k.lower() not in SECRET_KEYS}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


def config_digest(settings: BaseModel) -> str:
    """``sha256:<hex>`` of the settings as JSON, secrets (``SecretStr`` and keys named like one) left out."""
    raw = settings.model_dump(mode="python")

    def plain(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return None
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if not isinstance(v, SecretStr)}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        return value

    doc = _scrub(plain(raw))
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def jetson_release(root: Path) -> dict[str, str | None] | None:
    """Model and L4T release from /proc/device-tree/model and /etc/nv_tegra_release; None off a Jetson."""
    release = _read(root / "etc/nv_tegra_release")
    model = _read(root / "proc/device-tree/model").strip("\0 \n") or None
    if not release and "jetson" not in (model or "").lower():
        return None
    l4t = None
    if release.startswith("# R"):  # "# R36 (release), REVISION: 4.0, GCID: ..."
        major = release[3:].split(" ", 1)[0]
        revision = release.split("REVISION:", 1)[1].split(",", 1)[0].strip() if "REVISION:" in release else "0"
        l4t = f"{major}.{revision}"
    return {"model": model, "l4t": l4t}


def host_inventory(root: str | Path = "/") -> dict[str, Any]:
    """Host facts read now; what is not there is left out and named in ``absent``."""
    base = Path(root)
    uname = platform.uname()
    out: dict[str, Any] = {"kernel": uname.release, "arch": uname.machine, "cpu_cores": os.cpu_count()}
    absent = []
    os_release = _read(base / "etc/os-release")
    pretty = next(
        (
            line.split("=", 1)[1].strip().strip('"')
            for line in os_release.splitlines()
            if line.startswith("PRETTY_NAME=")
        ),
        None,
    )
    out["os"] = pretty or f"{uname.system} {uname.release}"
    cpuinfo = _read(base / "proc/cpuinfo")
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.split(":", 1)[0].strip() in ("model name", "Model", "Hardware") and ":" in line
        ),
        None,
    )
    if cpu:
        out["cpu_model"] = cpu
    else:
        absent.append("cpu_model")
    meminfo = _read(base / "proc/meminfo")
    total = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:")), None)
    if total and total.isdigit():
        out["memory_bytes"] = int(total) * 1024
    else:
        absent.append("memory")
    jetson = jetson_release(base)
    if jetson is None:
        absent.append("jetson")
    out["jetson"] = jetson
    out["absent"] = absent
    return out


def from_doctor(report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Accelerators and runtime versions from ``doctor.collect()``'s sections; absent ones named."""
    accelerators: dict[str, Any] = {}
    runtimes: dict[str, str] = {}
    absent = []
    for section in ("cuda", "tensorrt", "openvino", "onnxruntime"):
        entry = report.get(section) or {}
        status, data = entry.get("status"), entry.get("data") or {}
        if status != "ok":
            absent.append(section)
            if status == "error":
                accelerators[section] = {"error": str(entry.get("detail"))[:256]}
            continue
        if entry.get("version"):
            runtimes[section] = str(entry["version"])
        if section == "openvino":
            accelerators[section] = {
                "devices": data.get("devices", {}),
                "npu_nodes": data.get("npu_nodes", []),
                **({"npu_driver": data["npu_driver"]} if data.get("npu_driver") else {}),
            }
            emulation = data.get("npu_emulation", "off")
            if emulation != "off" or "NPU" in data.get("devices", {}):
                # an emulated NPU is never mistaken for silicon by whoever reads meta
                accelerators["npu"] = {"emulated": emulation != "off", "emulation": emulation}
        elif section == "onnxruntime":
            accelerators[section] = {"providers": data.get("providers", [])}
        else:
            accelerators[section] = {k: v for k, v in data.items() if isinstance(v, str | int | float | bool)}
    jetson = report.get("jetson") or {}
    if jetson.get("status") == "ok":
        data = jetson.get("data") or {}
        if data.get("jetpack"):
            runtimes["jetpack"] = str(data["jetpack"])
    python = report.get("python") or {}
    if python.get("version"):
        runtimes["python"] = str(python["version"])
    return {"accelerators": accelerators, "runtimes": runtimes, "probe_absent": absent}


class InventoryBook:
    """The inventory as it stands: host facts, probe findings, serving engines; thread-safe.
    ``update`` says whether anything changed (the caller republishes ``meta`` only then)."""

    def __init__(self, agent_version: str, digest: str, root: str | Path = "/") -> None:
        self._lock = threading.Lock()
        self._host = host_inventory(root)
        self._probes: dict[str, Any] | None = None
        self._serving: list[dict[str, Any]] = []
        self._version, self._digest = agent_version, digest

    def update(
        self,
        *,
        probes: dict[str, Any] | None = None,
        serving: list[dict[str, Any]] | None = None,
        digest: str | None = None,
    ) -> bool:
        with self._lock:
            before = self._doc()
            if probes is not None:
                self._probes = probes
            if serving is not None:
                self._serving = list(serving)
            if digest is not None:
                self._digest = digest
            return self._doc() != before

    def _doc(self) -> dict[str, Any]:
        host = dict(self._host)
        absent = list(host.pop("absent", []))
        probes = self._probes or {}
        absent += probes.get("probe_absent", [])
        jetson = host.get("jetson")
        if jetson is not None and probes.get("runtimes", {}).get("jetpack"):
            host["jetson"] = {**jetson, "jetpack": probes["runtimes"]["jetpack"]}
        return {
            "agent_version": self._version,
            "config_digest": self._digest,
            **host,
            "accelerators": probes.get("accelerators", {}),
            "runtimes": probes.get("runtimes", {}),
            "serving": self._serving,
            "probed": self._probes is not None,
            "absent": absent,
        }

    def model(self) -> Inventory:
        with self._lock:
            return Inventory.model_validate(self._doc())
