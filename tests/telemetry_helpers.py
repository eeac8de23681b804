"""Shared pieces of the telemetry integration tests: a fleet-side watcher and an agent-side rig."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_agent.config import MqttConfig, TelemetryConfig
from edge_agent.telemetry.fleet import FleetView
from edge_agent.telemetry.service import Telemetry
from tests.mqtt_broker import wait_for


class Watcher:
    """What a fleet manager runs: subscribes to edge/v1/+/#, keeps every message, feeds a FleetView."""

    def __init__(
        self,
        port: int,
        *,
        topics: tuple[str, ...] = ("edge/v1/+/#", "fleet/replies/#"),
        client_id: str = "watcher",
        persistent: bool = False,
        **tls: Any,
    ) -> None:
        self.messages: list[tuple[str, bytes, Any]] = []
        self.view = FleetView(window_s=1e9)
        self._lock = threading.Lock()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if tls:
            self.client.tls_set(**tls)
        self.client.on_connect = lambda c, *_a: c.subscribe([(t, 1) for t in topics])
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.1, 1)
        props = None
        if persistent:  # what a real fleet consumer holds: the broker queues for it while it is away
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", port, keepalive=10, clean_start=not persistent, properties=props)
        self.client.loop_start()
        assert self.subscribed.wait(15), "watcher did not subscribe"

    def _on_message(self, _c, _u, m) -> None:
        with self._lock:
            self.messages.append((m.topic, bytes(m.payload), m.properties))
        self.view.ingest(m.topic, bytes(m.payload))

    def docs(self, suffix: str) -> list[dict]:
        with self._lock:
            return [json.loads(p) for t, p, _ in self.messages if t.endswith(suffix) and p]

    def seqs(self, device: str = "dev-1") -> list[int]:
        return [d["seq"] for d in self.docs("tele/latency") if d["device_id"] == device]

    def request(
        self,
        topic: str,
        body: dict | bytes,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        expiry_s: int | None = None,
    ) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic:
            props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        if expiry_s is not None:
            props.MessageExpiryInterval = expiry_s
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.client.publish(topic, payload, qos=1, properties=props).wait_for_publish(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def make_telemetry(
    tmp_path: Path,
    port: int,
    *,
    device_id: str = "dev-1",
    interval_s: float = 0.2,
    mqtt_extra: dict | None = None,
    tele_extra: dict | None = None,
    **kw: Any,
) -> Telemetry:
    mcfg = MqttConfig(host="127.0.0.1", port=port, device_id=device_id, reconnect_max_s=2, **(mqtt_extra or {}))
    tcfg = TelemetryConfig(
        interval_s=interval_s,
        spool_path=tmp_path / f"{device_id}.spool.sqlite",
        ledger_path=tmp_path / f"{device_id}.ledger.sqlite",
        replay_per_s=200,
        **(tele_extra or {}),
    )
    return Telemetry(mcfg, tcfg, **kw)


class Load:
    """Inference stand-in: a thread observing requests as fast as a busy device would."""

    def __init__(self, tele: Telemetry, per_s: float = 200.0) -> None:
        self.tele, self.period = tele, 1.0 / per_s
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            self.tele.accumulator.observe(
                "llm", "small", "demo-phi3", {"ttft_ms": [20.0 + k % 50], "itl_ms": [5.0, 6.0]}, tokens_out=3
            )
            self.count += 1
            time.sleep(self.period)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def drained(tele: Telemetry, timeout_s: float = 60.0) -> None:
    """Nothing older than a second is left in the spool (windows keep coming every interval)."""

    def done() -> bool:
        horizon = time.time() - 1.0
        return all(r.created_wall > horizon for r in tele.spool.pending(1000))

    try:
        wait_for(done, timeout_s, what="spool to drain")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left: {tele.spool.records}, stats {tele.stats()}") from None


def assert_no_gaps(seqs: list[int]) -> None:
    unique = sorted(set(seqs))
    assert unique, "no windows received"
    missing = sorted(set(range(unique[0], unique[-1] + 1)) - set(unique))
    assert not missing, f"seq gaps after dedup: {missing[:20]}"
