"""sd_notify on a datagram socket the test owns (path and abstract), and the heartbeat-gated watchdog."""

from __future__ import annotations

import os
import socket
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


def test_watchdog_pings_only_while_the_loop_progresses(listener):
    sock, address = listener
    state = {"steps": 0, "busy": True}
    beat = LoopHeartbeat(lambda: state["steps"], lambda: state["busy"])
    dog = Watchdog(Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"}), beat).start()
    try:
        state["steps"] += 1
        assert recv(sock) == {"WATCHDOG": "1"}  # progressed
        time.sleep(0.3)  # busy and stuck: no pings
        missed = dog.missed
        assert missed >= 2
        state["busy"] = False  # idle is healthy
        assert recv(sock) == {"WATCHDOG": "1"}
    finally:
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
