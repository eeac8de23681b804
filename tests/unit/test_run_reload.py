"""SIGHUP handling of ``edge-agent run`` (``cli.run._Reloads``): RELOADING=1 + MONOTONIC_USEC, the reload,
then READY=1 with its outcome; one during the start waits for serving; one while stopping is ignored."""

from __future__ import annotations

import socket

import pytest

from edge_agent.cli.run import _Reloads
from edge_agent.systemd import Notifier


class StubAgent:
    def __init__(self, notifier: Notifier, outcome: str | Exception) -> None:
        self.notifier, self.outcome, self.reloads = notifier, outcome, 0

    def reload(self) -> str:
        self.reloads += 1
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.fixture
def notify(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.3)
    yield sock, Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    sock.close()


def received(sock) -> list[dict[str, str]]:
    out = []
    try:
        while True:
            out.append(dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines()))
    except TimeoutError:
        return out


def test_a_reload_is_framed_by_reloading_and_ready(notify):
    sock, notifier = notify
    agent = StubAgent(notifier, "reloaded: applied sla")
    reloads = _Reloads(agent)  # type: ignore[arg-type]
    reloads.serving()
    reloads._reload()
    first, second = received(sock)
    assert first["RELOADING"] == "1" and int(first["MONOTONIC_USEC"]) > 0
    assert second == {"READY": "1", "STATUS": "reloaded: applied sla"}


def test_a_refused_or_failing_reload_still_ends_with_ready(notify):
    sock, notifier = notify
    reloads = _Reloads(StubAgent(notifier, "reload refused, keeping the running config: x: bad"))  # type: ignore[arg-type]
    reloads.serving()
    reloads._reload()
    assert received(sock)[-1] == {"READY": "1", "STATUS": "reload refused, keeping the running config: x: bad"}
    reloads = _Reloads(StubAgent(notifier, RuntimeError("boom")))  # type: ignore[arg-type]
    reloads.serving()
    reloads._reload()
    last = received(sock)[-1]
    assert last["READY"] == "1" and last["STATUS"] == "reload failed, keeping the running config: boom"


def test_sighup_during_start_waits_for_serving_and_during_stop_is_ignored(notify):
    sock, notifier = notify
    agent = StubAgent(notifier, "reloaded: applied sla")
    reloads = _Reloads(agent)  # type: ignore[arg-type]
    reloads._reload()
    assert agent.reloads == 0 and received(sock) == []  # no READY=1 before the start's own
    reloads.serving()
    assert agent.reloads == 1 and [m.get("READY") for m in received(sock)] == [None, "1"]
    reloads.stopping()
    reloads._reload()
    assert agent.reloads == 1 and received(sock) == []
