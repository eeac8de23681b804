"""``edge-agent fleet simulate`` through a real mosquitto: every message is a valid payload of the agent's
schema, each device has its own id and a contiguous ``seq``, and the retained topics are there."""

from __future__ import annotations

import subprocess
import sys
import threading

import paho.mqtt.client as mqtt

from edge_agent.telemetry.schema import LatencyWindow, Meta, Reported, State
from tests.mqtt_broker import Broker, wait_for


def test_simulated_devices_publish_valid_windows_with_their_own_seq(tmp_path):
    broker = Broker(tmp_path).start()
    got: list[tuple[str, bytes, bool]] = []
    lock = threading.Lock()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sim-check", protocol=mqtt.MQTTv5)
    ready = threading.Event()

    def on_message(_c, _u, m):
        with lock:
            got.append((m.topic, bytes(m.payload), bool(m.retain)))

    client.on_connect = lambda c, *_: (c.subscribe("edge/v1/+/#", qos=1), ready.set())
    client.on_message = on_message
    try:
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        assert ready.wait(10)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "edge_agent",
                "fleet",
                "simulate",
                "--broker",
                f"127.0.0.1:{broker.port}",
                "--devices",
                "7",
                "--interval-s",
                "0.2",
                "--duration-s",
                "1.0",
                "--devices-per-connection",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        wait_for(lambda: sum(t.endswith("/state") for t, _p, _r in got) >= 14, 10, what="offline states")
    finally:
        client.loop_stop()
        client.disconnect()
        broker.stop()
    seqs: dict[str, list[int]] = {}
    kinds: dict[str, set[str]] = {}
    for topic, payload, _retained in got:
        device, kind = topic.split("/")[2], "/".join(topic.split("/")[3:])
        kinds.setdefault(device, set()).add(kind)
        model = {"tele/latency": LatencyWindow, "state": State, "reported": Reported, "meta": Meta}[kind]
        msg = model.model_validate_json(payload)  # the agent's own schema accepts every message
        assert msg.device_id == device
        if isinstance(msg, LatencyWindow):
            seqs.setdefault(device, []).append(msg.seq)
            (series,) = msg.series
            assert series.requests == 20 and series.histograms["ttft_ms"].count == 20
    assert len(seqs) == 7
    for device, numbers in seqs.items():
        assert sorted(numbers) == list(range(1, len(numbers) + 1)), device  # no gap, no duplicate
        assert len(numbers) >= 3
        assert kinds[device] == {"tele/latency", "state", "reported", "meta"}
