"""`edge-agent doctor`'s build line: engine building available, or why not."""

from __future__ import annotations

from pathlib import Path

from edge_agent.diagnostics import doctor


def test_without_onnx_building_is_absent_with_what_to_install(monkeypatch) -> None:
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda m: False if m == "onnx" else real(m))
    entry = doctor._build(5)
    assert entry.status == "absent"
    assert "pip install 'edge-agent[build]'" in entry.detail and "builds no engines" in entry.detail


def test_with_onnx_it_names_the_runtimes_and_where_recipes_are(monkeypatch, tmp_path: Path) -> None:
    if not doctor._installed("onnx"):
        import pytest

        pytest.skip("onnx is not installed here")
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no espeak-ng, no sox
    entry = doctor._build(5)
    assert entry.status == "ok" and entry.detail.startswith("engine building available for ONNX Runtime")
    assert str(tmp_path / "edge-agent" / "engines") in entry.detail and "demo-asr" in entry.data["recipes"]
    assert any("espeak-ng and sox missing" in w for w in entry.warnings)
