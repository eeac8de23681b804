"""Simulated devices for the fleet side (``edge-agent fleet simulate``, ``edge-agent bench fleet``).

Each simulated device builds its windows with the agent's own code: requests go into a
``WindowAccumulator`` (the same exponential histograms and local quantiles), the window is sealed
into the ``LatencyWindow`` model with its own ``device_id``, ``session`` and monotonic ``seq``, and
``state`` / ``reported`` / ``meta`` are the real payload models, retained as the agent sends them.
What is simulated is only the inference: latencies are drawn from a seeded log-normal per device.

Devices share MQTT connections (``devices_per_connection``, default 100): a thousand paho clients
would mean a thousand network threads in one process and measure the simulator's scheduler, not
the fleet side; the broker and the subscribers see exactly the per-device topics and retained
messages either way.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .schema import Health, LatencyWindow, Meta, Reported, State, WindowTimes
from .windows import WindowAccumulator

log = logging.getLogger(__name__)

VERSION = "sim"
TIERS = ("large", "small")


class SimDevice:
    """One simulated device: draws requests, seals real ``tele/latency`` windows with its own ``seq``."""

    def __init__(self, device_id: str, seed: int, requests_per_window: int = 20, keep_samples: bool = False) -> None:
        self.device_id, self.requests_per_window = device_id, requests_per_window
        self.rng = random.Random(seed)
        self.median_ms = 80.0 * math.exp(self.rng.uniform(-0.5, 1.0))  # devices differ, as real ones do
        self.tier = TIERS[seed % 2]
        self.seq = 0
        self.session = 1
        self.acc = WindowAccumulator(max_local_samples=256, seed=seed)
        self.samples: list[float] | None = [] if keep_samples else None  # the TTFTs drawn, for a reference
        self._start = (time.monotonic(), time.time())

    def window(self, wall: float | None = None, mono: float | None = None) -> bytes:
        """Draw one window's requests and seal it: the ``tele/latency`` payload."""
        for _ in range(self.requests_per_window):
            ttft = self.rng.lognormvariate(math.log(self.median_ms), 0.35)
            itl = self.rng.lognormvariate(math.log(self.median_ms / 4), 0.25)
            if self.samples is not None:
                self.samples.append(ttft)
            self.acc.observe(
                "llm",
                self.tier,
                "sim-llm",
                {"ttft_ms": [ttft], "itl_ms": [itl], "e2e_ms": [ttft + 30 * itl]},
                tokens_out=31,
            )
        end_mono = time.monotonic() if mono is None else mono
        end_wall = time.time() if wall is None else wall
        start_mono, start_wall = self._start
        self._start = (end_mono, end_wall)
        duration = max(0.0, end_mono - start_mono)
        self.seq += 1
        series = [s.to_series(duration) for s in self.acc.take()]
        temp = round(self.rng.uniform(45.0, 80.0), 1)
        health = Health(
            process_cpu_percent=round(self.rng.uniform(20, 90), 1),
            temperatures_c={"cpu": temp},
            max_temp_c=temp,
            absent=["nvpmodel", "ina3221", "rapl", "npu"],
        )
        return LatencyWindow(
            device_id=self.device_id,
            session=self.session,
            boot_id="sim",
            seq=self.seq,
            clock_synced=True,
            window=WindowTimes(
                start_wall=start_wall, end_wall=end_wall, start_mono=start_mono, end_mono=end_mono, duration_s=duration
            ),
            series=series,
            version=VERSION,
            health=health,
        ).to_json()

    def retained(self, state: str = "online") -> list[tuple[str, bytes]]:
        """``state``, ``reported`` and ``meta`` (topic suffix, payload), as the agent retains them."""
        return [
            (
                "state",
                State(
                    device_id=self.device_id,
                    state=state,
                    session=self.session,
                    boot_id="sim",
                    version=VERSION,
                    at_wall=time.time(),
                ).to_json(),
            ),
            ("reported", Reported(device_id=self.device_id, active_tiers={"llm": self.tier}).to_json()),
            (
                "meta",
                Meta(
                    device_id=self.device_id, version=VERSION, tiers={"llm": list(TIERS)}, histogram_relative_error=0.0
                ).to_json(),
            ),
        ]


class Simulator:
    """N ``SimDevice`` s publishing one window each per ``interval_s`` over shared MQTT connections."""

    def __init__(
        self,
        host: str,
        port: int,
        devices: int,
        interval_s: float = 1.0,
        prefix: str = "edge/v1",
        devices_per_connection: int = 100,
        requests_per_window: int = 20,
        qos: int = 1,
    ) -> None:
        self.host, self.port, self.prefix, self.interval_s, self.qos = host, port, prefix, interval_s, qos
        self.devices = [
            SimDevice(f"sim-{i:05d}", seed=i, requests_per_window=requests_per_window) for i in range(devices)
        ]
        self.per_conn = max(1, devices_per_connection)
        self.clients: list[Any] = []
        self.published = 0
        self.late_rounds = 0  # rounds that could not be published within the interval
        self._stop = threading.Event()

    def _client(self, i: int) -> Any:
        import paho.mqtt.client as mqtt

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edge-sim-{i}", protocol=mqtt.MQTTv5)
        client.max_queued_messages_set(0)
        client.max_inflight_messages_set(1000)
        client.connect(self.host, self.port, keepalive=30)
        client.loop_start()
        return client

    def start(self) -> Simulator:
        for i in range(math.ceil(len(self.devices) / self.per_conn)):
            self.clients.append(self._client(i))
        for k, dev in enumerate(self.devices):
            for suffix, payload in dev.retained():
                self._publish(k, f"{self.prefix}/{dev.device_id}/{suffix}", payload, retain=True)
        return self

    def _publish(self, k: int, topic: str, payload: bytes, retain: bool = False) -> Any:
        info = self.clients[k // self.per_conn].publish(topic, payload, qos=self.qos, retain=retain)
        self.published += 1
        return info

    def run(self, duration_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        """Publish rounds until ``duration_s`` has passed (or ``stop``); each round spread over the interval."""
        start = clock()
        next_round = start
        while not self._stop.is_set() and (duration_s is None or clock() - start < duration_s):
            for k, dev in enumerate(self.devices):
                self._publish(k, f"{self.prefix}/{dev.device_id}/tele/latency", dev.window())
            next_round += self.interval_s
            delay = next_round - clock()
            if delay < 0:
                self.late_rounds += 1
                next_round = clock()
            self._stop.wait(max(0.0, delay))

    def stop(self) -> None:
        self._stop.set()

    def close(self, offline: bool = True, timeout_s: float = 5.0) -> None:
        """Retain ``offline`` for every device, wait until those are out, then disconnect.

        A ``disconnect`` + ``loop_stop`` straight after ``publish`` can stop the network thread before the
        last queued packets are written, so each offline state is awaited (bounded) first."""
        pending = []
        for k, dev in enumerate(self.devices):
            if offline:
                topic = f"{self.prefix}/{dev.device_id}/state"
                pending.append(self._publish(k, topic, dev.retained("offline")[0][1], retain=True))
        deadline = time.monotonic() + timeout_s
        for info in pending:
            try:
                info.wait_for_publish(max(0.0, deadline - time.monotonic()))
            except (RuntimeError, ValueError):  # not queued (no connection) or timed out: nothing more to do
                pass
        for client in self.clients:
            client.disconnect()
            client.loop_stop()
