"""``fleet watch --once --json`` against a real mosquitto: an idle device (retained ``state`` and
``reported``, no window yet) shows its tier; a device whose windows stopped is marked stale."""

from __future__ import annotations

import json
import subprocess
import sys

import paho.mqtt.client as mqtt
import pytest

from edge_agent.telemetry.schema import LatencyWindow, Reported, State, WindowTimes
from tests.conftest import REPO
from tests.mqtt_broker import Broker


@pytest.fixture
def broker(tmp_path):
    with Broker(tmp_path / "broker").start() as b:
        yield b


def publish(port: int, msgs: list[tuple[str, bytes, bool]]) -> None:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        for topic, payload, retain in msgs:
            c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)
    finally:
        c.disconnect()
        c.loop_stop()


def watch_once(port: int, *extra: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "fleet",
            "watch",
            "--broker",
            f"127.0.0.1:{port}",
            "--once",
            "--json",
            "--settle-s",
            "1.0",
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_idle_device_shows_the_tier_from_retained_reported(broker):
    state = State(device_id="dev-1", state="online", session=4, boot_id="b", version="t").to_json()
    reported = Reported(device_id="dev-1", active_tiers={"llm": "small"}).to_json()
    publish(broker.port, [("edge/v1/dev-1/state", state, True), ("edge/v1/dev-1/reported", reported, True)])
    snap = watch_once(broker.port)
    (dev,) = snap["devices"]
    assert (dev["device"], dev["state"], dev["tier"], dev["count"], dev["stale"]) == (
        "dev-1",
        "online",
        "small",
        0,
        False,
    )
    assert dev["cpu_temp_c"] is None and dev["asr_first_partial_p95_ms"] is None
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "fleet",
            "watch",
            "--broker",
            f"127.0.0.1:{broker.port}",
            "--once",
            "--settle-s",
            "1.0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("dev-1"))
    assert row.split()[:3] == ["dev-1", "online", "small"]


def test_a_retained_window_long_past_its_interval_is_stale_on_arrival_only_after_three_intervals(broker):
    # A window retained on the broker arrives at once; with a 0.2 s interval and a 1 s settle the
    # device has been quiet for more than 3 intervals by the snapshot.
    win = LatencyWindow(
        device_id="dev-2",
        session=1,
        boot_id="b",
        seq=1,
        clock_synced=True,
        version="t",
        window=WindowTimes(start_wall=0, end_wall=0.2, start_mono=0, end_mono=0.2, duration_s=0.2),
    )
    state = State(device_id="dev-2", state="online", session=1, boot_id="b", version="t").to_json()
    publish(broker.port, [("edge/v1/dev-2/state", state, True), ("edge/v1/dev-2/tele/latency", win.to_json(), True)])
    (dev,) = watch_once(broker.port)["devices"]
    assert dev["stale"] is True and dev["last_window_age_s"] > 0.6 and dev["interval_s"] == 0.2
