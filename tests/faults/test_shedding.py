"""Shedding ends (issue 14, fault 2). With an SLA no request can meet (a fleet ``set_sla`` with
``target_ms: 0.001``), the lightest tier truncates and then sheds (HTTP 503). Shedding used to last
for ever: nothing admitted means no samples, and with too few samples the controller changed
nothing. Now, after the load stops, a request is served again within ``cooldown_s + window_s``,
with the impossible SLA still in force, and at once when the fleet restores a sane SLA.

A real ``edge-agent run`` (one demo-phi3 tier), a real mosquitto, plain HTTP and MQTT clients.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.daemon_proc import Daemon, wait_for
from tests.mqtt_broker import Broker

pytest.importorskip("paho.mqtt.client")

WINDOW_S, COOLDOWN_S = 3.0, 4.0
SLA = f"""window_s = {WINDOW_S}
min_samples = 2
cooldown_s = {COOLDOWN_S}
min_dwell_s = 0
shed_after = 1
[batching]
admission = false
"""  # appended to the e2e config (its [sla] has evaluate_every_s = 1); with admission on, an impossible
# target refuses every chat at once (429) on its prediction: this test is about shedding


def complete(daemon: Daemon, timeout_s: float = 30.0) -> int:
    """One small completion; returns the HTTP status."""
    body = json.dumps({"model": "small", "prompt": "Hi", "max_tokens": 3, "temperature": 0}).encode()
    req = urllib.request.Request(daemon.url("/v1/completions"), body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def command(broker: Broker, daemon: Daemon, name: str, cmd_id: str, args: dict) -> dict:
    """Publish ``cmd/<name>/req`` and wait for its final response (the daemon's own ``res`` topic)."""
    import paho.mqtt.publish as publish

    topic = f"edge/v1/{daemon.device}/cmd/{name}"
    publish.single(
        f"{topic}/req",
        json.dumps({"cmd_id": cmd_id, "args": args}),
        qos=1,
        hostname="127.0.0.1",
        port=broker.port,
        client_id=f"fleet-{cmd_id}",
    )
    final = ("succeeded", "failed", "rejected", "expired")
    return wait_for(
        lambda: next(
            (
                m
                for m in daemon.listener.of(f"cmd/{name}/res")
                if m.get("cmd_id") == cmd_id and m.get("status") in final
            ),
            None,
        ),
        20,
        what=f"the final response to {name} {cmd_id}",
    )


def load_until_shed(daemon: Daemon, max_s: float = 60.0) -> int:
    """Three clients back to back until one of them is refused with 503; returns how many were served."""
    shed, served, stop = threading.Event(), [], time.monotonic() + max_s

    def client() -> None:
        while not shed.is_set() and time.monotonic() < stop:
            status = complete(daemon)
            if status == 503:
                shed.set()
            elif status == 200:
                served.append(1)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_s + 35)
    assert shed.is_set(), f"no 503 after {max_s} s of load over an impossible target ({len(served)} served)"
    return len(served)


def first_served_after(daemon: Daemon, limit_s: float, every_s: float = 0.25) -> float | None:
    """Seconds until a request is served again (polling, one request at a time), or None within limit_s."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if complete(daemon) == 200:
            return time.monotonic() - start
        time.sleep(every_s)
    return None


@pytest.fixture
def rig(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port, extra=SLA)
    try:
        daemon.start()
        wait_for(lambda: daemon.listener.of("reported"), 30, what="the first reported")
        yield broker, daemon
    finally:
        print(daemon.close()[-3000:])  # shown by pytest only when the test fails
        broker.kill()


def test_shedding_ends_after_the_load_stops_and_at_once_when_the_sla_is_restored(rig):
    broker, daemon = rig
    impossible = {"workload": "llm", "sla": {"target_ms": 0.001, "window_s": WINDOW_S, "min_samples": 2}}
    assert command(broker, daemon, "set_sla", "sla-impossible", impossible)["status"] == "succeeded"

    served = load_until_shed(daemon)
    # The SLA is still impossible; the load has stopped. Bounded: cooldown_s + window_s (+ one
    # evaluation period and a request's own time as slack).
    bound = COOLDOWN_S + WINDOW_S
    after = first_served_after(daemon, limit_s=bound + 20)
    print(f"served {served} before shedding; first 200 after the load stopped: {after} s (bound {bound} s)")
    assert after is not None, f"still shedding {bound + 20:.0f} s after the load stopped"
    assert after <= bound + 2.0, f"served again only after {after:.1f} s, over cooldown_s + window_s = {bound} s"

    # Shedding again under load, then the fleet restores a sane SLA: served without waiting.
    load_until_shed(daemon)
    sane = {"workload": "llm", "sla": {"target_ms": 60_000, "window_s": WINDOW_S, "min_samples": 2}}
    assert command(broker, daemon, "set_sla", "sla-restored", sane)["status"] == "succeeded"
    restored = first_served_after(daemon, limit_s=bound + 20)
    print(f"first 200 after the SLA was restored: {restored} s")
    assert restored is not None and restored <= bound + 2.0, restored
