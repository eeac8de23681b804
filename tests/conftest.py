from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test reads the machine's /etc config, the developer's EDGE_AGENT_* vars or their caches."""
    for key in list(os.environ):
        if key.startswith("EDGE_AGENT_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr("edge_agent.config.DEFAULT_CONFIG", tmp_path / "no-such-agent.toml")
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
