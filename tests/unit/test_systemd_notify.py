"""sd_notify on a datagram socket the test owns (path and abstract), and the heartbeat-gated watchdog."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

import pytest

from edge_agent.systemd import LoopHeartbeat, Notifier, Watchdog


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        name = f"edge-agent-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name)
        address = "@" + name
    sock.settimeout(5)
    yield sock, address
    sock.close()


def recv(sock) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


def test_ready_status_extend_and_stopping_reach_the_socket(listener):
    sock, address = listener
    n = Notifier({"NOTIFY_SOCKET": address})
    assert n.ready("serving demo-phi3-small")
    assert recv(sock) == {"READY": "1", "STATUS": "serving demo-phi3-small"}
    assert n.extend_timeout(90)
    assert recv(sock) == {"EXTEND_TIMEOUT_USEC": "90000000"}
    assert n.stopping()
    assert recv(sock) == {"STOPPING": "1", "STATUS": "draining"}


def test_without_notify_socket_everything_is_a_no_op():
    n = Notifier({})
    assert not n.enabled and not n.ready("x") and n.watchdog_s is None


def test_a_missing_socket_is_logged_not_raised(tmp_path):
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).status("hello") is False


def test_watchdog_usec_for_another_pid_is_ignored():
    assert Notifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_s == 2.0
    assert Notifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}).watchdog_s is None


class SteppedCheck:
    """The watchdog's health check, run one check per ``step()`` of the test: ``step`` lets the watchdog's
    next check through and returns its verdict. The watchdog thread reaching check k+1 means it has
    acted on check k (pinged or counted a miss), so the test reads its counters with no timing guess.
    The waits are bounded only as a safety net against a watchdog that stopped checking."""

    def __init__(self, check) -> None:
        self.check = check
        self._go = threading.Semaphore(0)
        self._verdicts: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._closed = False

    def __call__(self) -> bool:
        if not self._closed:
            assert self._go.acquire(timeout=10), "the test never let this check through"
        ok = self.check()
        self._verdicts.put(ok)
        return ok

    def step(self) -> bool:
        self._go.release()
        return self._verdicts.get(timeout=10)

    def close(self) -> None:
        """Let every further check through (the watchdog is being stopped)."""
        self._closed = True
        self._go.release()


def test_watchdog_pings_only_while_the_loop_progresses(listener):
    sock, address = listener
    state = {"steps": 0, "busy": True}
    checks = SteppedCheck(LoopHeartbeat(lambda: state["steps"], lambda: state["busy"]))
    dog = Watchdog(Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"}), checks)
    assert dog.interval_s == 0.05  # half of WATCHDOG_USEC
    dog.start()
    try:
        state["steps"] += 1
        assert checks.step() is True  # progressed
        assert recv(sock) == {"WATCHDOG": "1"}
        assert checks.step() is False  # busy and stuck: no pings
        assert checks.step() is False
        state["busy"] = False  # idle is healthy
        assert checks.step() is True
        assert dog.missed == 2  # both stuck checks were counted before this one ran
        assert recv(sock) == {"WATCHDOG": "1"}
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # that was the only datagram since the first: none while stuck
            sock.recv(4096)
    finally:
        checks.close()
        dog.stop()


def test_reloading_carries_the_monotonic_clock_in_microseconds(listener):
    sock, address = listener
    n = Notifier({"NOTIFY_SOCKET": address})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    message = recv(sock)
    assert message["RELOADING"] == "1" and "STATUS" in message
    assert before <= int(message["MONOTONIC_USEC"]) <= after
