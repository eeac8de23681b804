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


def test_two_exporters_of_one_share_group_split_the_windows_and_both_get_every_retained_state(tmp_path):
    from edge_agent.telemetry.fleet_export import FleetStore, MqttFeed, subscriptions
    from edge_agent.telemetry.simulate import SimDevice

    broker = Broker(tmp_path).start()
    stores = [FleetStore(), FleetStore()]
    feeds = [
        MqttFeed(s, "127.0.0.1", broker.port, subscriptions("edge/v1", "g"), client_id=f"exp-{i}").start()
        for i, s in enumerate(stores)
    ]
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub", protocol=mqtt.MQTTv5)
    try:
        assert all(f.subscribed.wait(10) for f in feeds)
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        devices = [SimDevice(f"dev-{d}", seed=d) for d in range(4)]
        for dev in devices:
            for suffix, payload in dev.retained():
                client.publish(f"edge/v1/{dev.device_id}/{suffix}", payload, qos=1, retain=True).wait_for_publish(5)
            for _ in range(10):
                client.publish(f"edge/v1/{dev.device_id}/tele/latency", dev.window(), qos=1).wait_for_publish(5)

        def counted() -> int:
            return sum(h.count for s in (stores[0], stores[1]) if (h := s.fleet_histogram("llm", "ttft_ms")))

        wait_for(lambda: counted() == 4 * 10 * 20, 15, what="every window in one exporter or the other")
    finally:
        client.loop_stop()
        client.disconnect()
        for f in feeds:
            f.stop()
        broker.stop()
    windows = [sum(d.seq.received for d in s.devices.values()) for s in stores]
    assert sum(windows) == 40 and min(windows) > 0, windows  # split, each window once
    for s in stores:  # the retained topics are on plain subscriptions: every exporter knows every device
        assert {d.device_id: d.online for d in s.devices.values()} == {f"dev-{d}": 1.0 for d in range(4)}
