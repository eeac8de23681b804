"""Long builds keep systemd patient: EXTEND_TIMEOUT_USEC on a socket the test owns, rate-limited by a fake clock."""

from __future__ import annotations

import io
import socket

from edge_agent.engines.heartbeat import Heartbeat
from edge_agent.progress import Progress
from edge_agent.systemd import Notifier


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_beats_extend_the_timeout_at_most_every_quarter_period(tmp_path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    clock = Clock()
    hb = Heartbeat(
        enabled=False, notifier=Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}), extend_s=120.0, clock=clock
    )
    hb.beat()
    hb.beat()  # same instant: no second message
    clock.now = 31.0
    hb.beat()
    messages = []
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except TimeoutError:
        pass
    sock.close()
    assert messages == ["EXTEND_TIMEOUT_USEC=120000000"] * 2


def test_progress_callback_draws_a_bar_with_eta() -> None:
    stream = io.StringIO()
    clock = Clock()
    hb = Heartbeat(enabled=True, notifier=Notifier({}), clock=clock)
    bar = Progress("calibrating", unit="batches", stream=stream, clock=clock, min_interval_s=0)
    update = hb.callback(bar)
    clock.now = 2.0
    update(1, 4)
    clock.now = 4.0
    update(4, 4)
    lines = stream.getvalue().splitlines()
    assert "25.0%" in lines[0] and "ETA    6s" in lines[0]
    assert "100.0%" in lines[-1]
