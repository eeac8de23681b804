"""SIGHUP and every section of ``Settings``: each is either applied in place or named in the reload's
outcome as waiting for a restart, never silently ignored. The list comes from the ``Settings`` model
itself, so a section added later fails here until it is given a decision.

A real ``Agent`` on a real config file, reloaded through the daemon's SIGHUP handler
(``cli.run._Reloads``: RELOADING=1, the reload, READY=1 with the outcome on a notify socket); no
model is loaded (a reload never loads one)."""

from __future__ import annotations

import io
import logging
import socket

import pytest
from pydantic import Field

from edge_agent import logsetup
from edge_agent.cli.run import _Reloads
from edge_agent.config import load_settings
from edge_agent.config.base import Section
from edge_agent.config.settings import Settings
from edge_agent.daemon import reload
from edge_agent.daemon.app import Agent
from edge_agent.systemd import Notifier

BASE = """
[models]
asr = []
[[models.llm]]
name = "top"
model = "demo-phi3"

[sla]
target_ms = 400
"""


def test_every_section_of_settings_is_applied_or_named_as_needing_a_restart():
    assert reload.unclassified(Settings) == []
    assert not set(reload.APPLIED_LIVE) & set(reload.NEEDS_RESTART)
    assert set(reload.APPLIED_LIVE) | set(reload.NEEDS_RESTART) == set(Settings.model_fields)


def test_a_new_section_without_a_decision_is_caught():
    class Gadget(Section):
        """A section nobody has classified yet."""

        knob: int = 1

    class Later(Settings):
        """``Settings`` after someone adds ``[gadget]``."""

        gadget: Gadget = Field(default_factory=Gadget)

    assert reload.unclassified(Later) == ["gadget"]


@pytest.fixture
def notify(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.3)
    yield sock, Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    sock.close()


@pytest.fixture
def daemon_logging():
    """The daemon's logging as ``edge-agent run`` sets it up (``logsetup.configure``), put back afterwards."""
    root, ours = logging.getLogger(), logging.getLogger("edge_agent")
    saved = (list(root.handlers), root.level, ours.level, logsetup.level_in_force())
    logsetup.configure("info", "text", stream=io.StringIO())
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])
    ours.setLevel(saved[2])
    logsetup._in_force["level"] = saved[3]


def _sighup(tmp_path, notify, edit: str) -> tuple[Agent, str]:
    """Start from BASE, change the file by ``edit``, reload as SIGHUP does; the STATUS it ends with."""
    sock, notifier = notify
    path = tmp_path / "agent.toml"
    path.write_text(BASE)
    agent = Agent(load_settings(str(path)), str(path), notifier=notifier)
    path.write_text(BASE + edit)
    reloads = _Reloads(agent)
    reloads.serving()
    reloads._reload()
    messages = []
    try:
        while True:
            messages.append(dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines()))
    except TimeoutError:
        pass
    assert messages[0]["RELOADING"] == "1" and messages[-1]["READY"] == "1"
    return agent, messages[-1]["STATUS"]


def test_a_calibration_change_is_named_as_needing_a_restart(tmp_path, notify):
    agent, status = _sighup(tmp_path, notify, f'\n[calibration]\ncapture_dir = "{tmp_path / "cap"}"\n')
    assert status.startswith("reloaded: applied sla")
    assert "changes to calibration take effect after a restart" in status
    assert agent.settings.calibration.capture_dir is None  # what runs is still what started


def test_a_logging_level_change_applies_at_once(tmp_path, notify, daemon_logging):
    assert not logging.getLogger("edge_agent.daemon.app").isEnabledFor(logging.DEBUG)
    agent, status = _sighup(tmp_path, notify, '\n[logging]\nlevel = "debug"\n')
    assert "logging level info → debug" in status and "restart" not in status
    assert logging.getLogger("edge_agent.daemon.app").isEnabledFor(logging.DEBUG)
    assert logging.getLogger().level == logging.DEBUG
    assert agent.settings.logging.level == "debug"


def test_a_logging_format_change_is_named_as_needing_a_restart(tmp_path, notify, daemon_logging):
    agent, status = _sighup(tmp_path, notify, '\n[logging]\nformat = "json"\n')
    assert "changes to logging.format take effect after a restart" in status
    assert agent.settings.logging.format == "text"


def test_a_level_given_on_the_command_line_stays_and_the_reload_says_so(tmp_path, notify, daemon_logging):
    logsetup.configure("warning", "text", stream=io.StringIO())  # edge-agent run --log-level warning
    _agent, status = _sighup(tmp_path, notify, '\n[logging]\nlevel = "debug"\n')
    assert "logging level stays warning (given on the command line)" in status
    assert logging.getLogger().level == logging.WARNING


def test_several_sections_at_once_are_each_named(tmp_path, notify):
    edit = "\n[calibration]\ncapture_rate = 0.5\n[device]\nthreads = 2\n[audio]\nchunk_ms = 640\n"
    _agent, status = _sighup(tmp_path, notify, edit)
    restart = status.split("changes to ", 1)[1].split(" take effect", 1)[0].split(", ")
    assert sorted(restart) == ["audio", "calibration", "device"]
