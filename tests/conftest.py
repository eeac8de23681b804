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


@pytest.fixture(autouse=True)
def _isolated_logging():
    """A test that runs a command in-process (``cli.main``) configures logging the way the daemon
    does: one root handler bound to the ``sys.stderr`` of that moment, which pytest closes when the
    test ends. Put the root logger back, so that no later test logs into a closed stream."""
    import logging

    root = logging.getLogger()
    package = logging.getLogger("edge_agent")
    saved = (root.handlers[:], root.level, package.level)
    yield
    root.handlers[:], root.level, package.level = saved[0], saved[1], saved[2]
    logging.captureWarnings(False)
