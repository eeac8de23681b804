"""The device inventory for ``meta``: host facts from a fake tree, the doctor's findings, the config digest."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from pydantic import SecretStr

from edge_agent.config import MqttConfig, Settings
from edge_agent.telemetry.inventory import InventoryBook, config_digest, from_doctor, host_inventory
from edge_agent.telemetry.schema import SCHEMA_DIR, Meta


def put(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def jetson_tree(root: Path) -> Path:
    put(root, "etc/nv_tegra_release", "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic\n")
    put(root, "proc/device-tree/model", "NVIDIA Jetson Orin Nano Developer Kit\0")
    put(root, "proc/cpuinfo", "processor\t: 0\nmodel name\t: ARMv8 Processor rev 1 (v8l)\n")
    put(root, "proc/meminfo", "MemTotal:        7802000 kB\n")
    put(root, "etc/os-release", 'NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n')
    return root


DOCTOR = {
    "python": {"status": "ok", "version": "3.10.12"},
    "jetson": {"status": "ok", "version": "36.4", "data": {"jetpack": "6.2+b77"}},
    "cuda": {"status": "ok", "version": "12.6", "data": {"device": "Orin", "compute_capability": "8.7"}},
    "tensorrt": {"status": "ok", "version": "10.3.0", "data": {"installed": True, "version": "10.3.0"}},
    "openvino": {"status": "absent", "detail": "not installed"},
    "onnxruntime": {
        "status": "ok",
        "version": "1.20.0",
        "data": {"providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]},
    },
}


def test_host_inventory_of_a_jetson_tree(tmp_path: Path) -> None:
    host = host_inventory(jetson_tree(tmp_path))
    assert host["jetson"] == {"model": "NVIDIA Jetson Orin Nano Developer Kit", "l4t": "36.4.3"}
    assert host["cpu_model"] == "ARMv8 Processor rev 1 (v8l)"
    assert host["memory_bytes"] == 7_802_000 * 1024
    assert host["os"] == "Ubuntu 22.04.4 LTS"
    assert host["absent"] == []


def test_host_inventory_of_an_empty_tree_names_what_is_absent(tmp_path: Path) -> None:
    host = host_inventory(tmp_path)
    assert host["jetson"] is None and "cpu_model" not in host
    assert set(host["absent"]) == {"cpu_model", "memory", "jetson"}


def test_from_doctor_runtimes_accelerators_and_absent() -> None:
    found = from_doctor(DOCTOR)
    assert found["runtimes"] == {
        "cuda": "12.6",
        "tensorrt": "10.3.0",
        "onnxruntime": "1.20.0",
        "jetpack": "6.2+b77",
        "python": "3.10.12",
    }
    assert found["accelerators"]["onnxruntime"]["providers"][0] == "TensorrtExecutionProvider"
    assert found["accelerators"]["cuda"]["compute_capability"] == "8.7"
    assert found["probe_absent"] == ["openvino"]


def test_config_digest_is_sha256_of_the_settings_without_secrets() -> None:
    base = Settings()
    with_password = base.model_copy(update={"mqtt": MqttConfig(password=SecretStr("hunter2"))})
    other_password = base.model_copy(update={"mqtt": MqttConfig(password=SecretStr("swordfish"))})
    assert config_digest(with_password) == config_digest(other_password)  # a secret never moves the digest
    changed = base.model_copy(update={"sla": base.sla.model_copy(update={"target_ms": 123.0})})
    assert config_digest(changed) != config_digest(base)
    digest = config_digest(base)
    assert digest.startswith("sha256:") and len(digest) == 7 + 64


def test_book_merges_and_reports_changes_meta_validates(tmp_path: Path) -> None:
    book = InventoryBook("1.2.3", "sha256:" + "0" * 64, root=jetson_tree(tmp_path))
    assert book.model().probed is False
    serving = [
        {
            "workload": "llm",
            "tier": "small",
            "model": "demo-phi3",
            "identity": "engine:abc",
            "key": "abc",
            "backend": "tensorrt",
            "device": "cuda:0",
            "precision": "fp16",
            "built_at_wall": 1.7e9,
            "build_s": 42.0,
            "gate": {"passed": True, "metrics": {"cosine": 0.999}},
            "loaded": True,
        }
    ]
    assert book.update(serving=serving) is True
    assert book.update(serving=serving) is False  # the same again: no republish
    assert book.update(probes=from_doctor(DOCTOR)) is True
    inv = book.model()
    assert inv.probed and inv.jetson == {
        "model": "NVIDIA Jetson Orin Nano Developer Kit",
        "l4t": "36.4.3",
        "jetpack": "6.2+b77",
    }
    assert inv.serving[0].key == "abc" and inv.serving[0].gate == {"passed": True, "metrics": {"cosine": 0.999}}
    assert "openvino" in inv.absent
    meta = Meta(
        device_id="d1", version="1.2.3", histogram_relative_error=0.01, engines={"small": "engine:abc"}, inventory=inv
    )
    jsonschema.validate(json.loads(meta.to_json()), json.loads((SCHEMA_DIR / "meta.json").read_text()))


def test_the_cuda_probe_reports_ok_or_absent_never_its_own_error() -> None:
    """The inventory's CUDA entry comes from this probe: a machine without CUDA says absent (it said
    ``NameError: name 'json' is not defined`` when the probe's child printed its result)."""
    from edge_agent.diagnostics.doctor import _cuda

    entry = _cuda(60)
    assert entry.status in ("ok", "absent"), entry.detail


def test_the_openvino_probe_reports_the_npu_driver_version(monkeypatch) -> None:
    """An NPU's driver version reaches the inventory (a fake openvino module in the probe's child)."""
    from edge_agent.backends import probe
    from edge_agent.diagnostics import doctor

    fake = (
        "import sys, types\n"
        "ov = types.ModuleType('openvino')\n"
        "class Core:\n"
        "    available_devices = ['CPU', 'NPU']\n"
        "    def get_property(self, device, name):\n"
        "        return {'FULL_DEVICE_NAME': device + ' fake', 'NPU_DRIVER_VERSION': 1688}[name]\n"
        "ov.Core = Core\n"
        "ov.__version__ = '2099.1.0'\n"
        "sys.modules['openvino'] = ov\n"
    )
    monkeypatch.setitem(probe.PRELUDE, "openvino", fake)
    monkeypatch.setattr(doctor, "_installed", lambda module: True)
    entry = doctor._openvino(60)
    found = from_doctor({"openvino": {"status": entry.status, "version": entry.version, "data": entry.data}})
    assert found["accelerators"]["openvino"]["npu_driver"] == "1688"
    assert found["accelerators"]["openvino"]["devices"] == {"CPU": "CPU fake", "NPU": "NPU fake"}
    assert found["runtimes"]["openvino"] == "2099.1.0"
