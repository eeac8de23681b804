"""Doctor on this machine, and its crash safety: probes that segfault, hang or fail never take it down."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.backends import probe
from edge_agent.backends.tensorrt import probe_tensorrt
from edge_agent.diagnostics import doctor

SEGFAULT = "import os; os.kill(os.getpid(), 11)\n"


@pytest.fixture(scope="module")
def report() -> dict:
    return doctor.collect(timeout_s=60)


def test_every_section_has_a_valid_entry(report: dict) -> None:
    assert list(report) == list(doctor.SECTIONS)
    for name, entry in report.items():
        assert entry["status"] in ("ok", "absent", "error"), name
        assert isinstance(entry["detail"], str) and entry["detail"], name
        assert entry["version"] is None or isinstance(entry["version"], str), name
        assert isinstance(entry["warnings"], list), name
    assert report["system"]["status"] == "ok" and report["system"]["data"]["cores"] >= 1
    assert report["python"]["status"] == "ok"


def test_onnxruntime_is_ok_with_the_cpu_provider(report: dict) -> None:
    ort = report["onnxruntime"]
    assert ort["status"] == "ok"
    assert "CPUExecutionProvider" in ort["data"]["providers"]
    assert ort["version"]


def test_absent_sections_say_what_to_install(report: dict) -> None:
    for name in ("tensorrt", "openvino", "audio"):
        if report[name]["status"] == "absent":
            assert "install" in report[name]["detail"], name


def test_a_segfaulting_probe_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(probe.PRELUDE, "onnxruntime", SEGFAULT)
    report = doctor.collect(timeout_s=60)
    assert report["onnxruntime"]["status"] == "error"
    assert "SIGSEGV" in report["onnxruntime"]["detail"] and "-11" in report["onnxruntime"]["detail"]
    assert report["system"]["status"] == "ok"  # the other sections still come back
    assert "onnxruntime" in doctor.render_table(report)


def test_a_hanging_probe_times_out() -> None:
    result = probe.run_probe("import time; time.sleep(30)", timeout_s=1)
    assert result.data == {} and "timed out after 1 s" in result.error


def test_a_failing_probe_reports_its_exit_code_and_last_line() -> None:
    result = probe.run_probe("raise RuntimeError('driver said no')", timeout_s=30)
    assert "exited with code 1" in result.error and "driver said no" in result.error
    assert probe.run_probe("print('not json')", timeout_s=30).error == "probe printed no result"


def test_a_broken_probe_function_becomes_an_error_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_timeout: float) -> doctor.Entry:
        raise KeyError("surprise")

    monkeypatch.setattr(doctor, "_python", broken)
    report = doctor.collect(timeout_s=60)
    assert report["python"]["status"] == "error" and "KeyError" in report["python"]["detail"]


def _fake_tensorrt_package(root: Path, body: str) -> Path:
    (root / "tensorrt").mkdir()
    (root / "tensorrt" / "__init__.py").write_text(body)
    return root


def test_tensorrt_probe_reads_the_version_in_a_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = _fake_tensorrt_package(tmp_path, "__version__ = '10.3.0.26'\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert probe_tensorrt(timeout_s=60) == {"installed": True, "version": "10.3.0.26", "error": None}


def test_tensorrt_that_segfaults_on_import_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = _fake_tensorrt_package(tmp_path, SEGFAULT)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    probe = probe_tensorrt(timeout_s=60)
    assert probe["installed"] and probe["version"] is None and "SIGSEGV" in probe["error"]
    entry = doctor._tensorrt(60)
    assert entry.status == "error" and "SIGSEGV" in entry.detail


def test_tensorrt_absent_here_is_absent(report: dict) -> None:
    if report["tensorrt"]["data"].get("installed"):
        pytest.skip("TensorRT is installed on this machine")
    assert report["tensorrt"]["status"] == "absent"
    assert "JetPack" in report["tensorrt"]["detail"]


def test_render_table_mentions_every_section_and_warning() -> None:
    report = {
        name: {"status": "ok", "version": "1.0", "detail": f"{name} detail", "data": {}, "warnings": []}
        for name in doctor.SECTIONS
    }
    report["onnxruntime"]["warnings"] = ["onnxruntime and onnxruntime-gpu are all installed"]
    table = doctor.render_table(report)
    for name in doctor.SECTIONS:
        assert name in table and f"{name} detail" in table
    assert "warnings:" in table and "onnxruntime-gpu" in table
    assert table.splitlines()[0].split() == ["SECTION", "STATUS", "VERSION", "DETAIL"]


def test_an_npu_llm_tier_is_named_as_running_without_the_prefix_cache(tmp_path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        '[[models.llm]]\nname = "npu"\nmodel = "demo-phi3"\nbackend = "openvino"\ndevice = "NPU"\n'
        '[[models.llm]]\nname = "cpu"\nmodel = "demo-phi3"\n'
    )
    (note,) = doctor.prefix_cache_notes(config)
    assert "'npu'" in note and "without the prefix cache" in note
    config.write_text(config.read_text() + "[prefix_cache]\nenabled = false\n")
    assert doctor.prefix_cache_notes(config) == []
