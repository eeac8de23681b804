"""Log output: text for people, one JSON object per line (time, level, logger, message) for journald/Loki."""

from __future__ import annotations

import io
import json
import logging
import re
import threading

import pytest

from edge_agent.logsetup import configure


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    agent_level = logging.getLogger("edge_agent").level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.getLogger("edge_agent").setLevel(agent_level)
    logging.captureWarnings(False)


def test_json_lines_carry_time_level_logger_message_and_exceptions():
    stream = io.StringIO()
    configure("info", "json", stream=stream)
    log = logging.getLogger("edge_agent.test")
    log.info("tier %s serves %s", "small", "line\nbreak")
    log.debug("not shown at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    worker = threading.Thread(target=lambda: log.warning("from a thread"), name="engine-build", daemon=True)
    worker.start()
    worker.join()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # the newline inside a message is escaped, not a second line
    first, second, third = (json.loads(line) for line in lines)
    assert set(first) == {"time", "level", "logger", "message"}
    assert first["level"] == "INFO" and first["logger"] == "edge_agent.test"
    assert first["message"] == "tier small serves line\nbreak"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]
    assert third["thread"] == "engine-build"


def test_text_format_and_level():
    stream = io.StringIO()
    configure("warning", "text", stream=stream)
    logging.getLogger("edge_agent.x").info("hidden")
    logging.getLogger("edge_agent.x").warning("shown %d", 1)
    assert re.fullmatch(r"\S+ \S+ WARNING edge_agent\.x: shown 1\n", stream.getvalue())


def test_configure_replaces_earlier_handlers_and_rejects_unknown_values():
    first, second = io.StringIO(), io.StringIO()
    configure("info", "text", stream=first)
    configure("info", "json", stream=second)
    logging.getLogger("edge_agent.y").info("once")
    assert first.getvalue() == "" and json.loads(second.getvalue())["message"] == "once"
    with pytest.raises(ValueError):
        configure("info", "xml")
    with pytest.raises(ValueError):
        configure("loud", "text")


def test_run_takes_the_log_flags_before_or_after_the_command(monkeypatch):
    from edge_agent.cli import main
    from edge_agent.cli import run as run_command

    calls = []
    monkeypatch.setattr(
        run_command,
        "run",
        lambda config, log_format=None, log_level=None: calls.append((config, log_format, log_level)) or 0,
    )
    assert main(["run", "--config", "a.toml", "--log-format", "json"]) == 0
    assert main(["--log-format", "json", "--log-level", "error", "run"]) == 0
    assert main(["--debug", "run", "--log-level", "warning"]) == 0  # --debug means debug
    assert main(["run"]) == 0  # the config's [logging] decides
    assert calls == [("a.toml", "json", None), (None, "json", "error"), (None, None, "debug"), (None, None, None)]
