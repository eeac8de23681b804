"""The fleet's merged histograms and health as Prometheus metrics (``edge-agent fleet export``).

``FleetStore`` ingests MQTT messages (pure: ``ingest`` never raises) and keeps, per device and
(workload, tier, metric), one *cumulative* exponential histogram: every live window's histogram is
merged into it (``ExponentialHistogram.merge``, never an average of percentiles), so Prometheus'
``rate()`` and ``histogram_quantile`` work on it as on any classic histogram. A duplicate window
(at-least-once delivery) is recognised by its ``seq`` and not merged twice.

Classic buckets: Prometheus 2.x scrapes native histograms only in its protobuf format, which
``prometheus_client`` does not write, so the exporter writes classic cumulative ``_bucket{le}``
series. The ``le`` boundaries are the exponential boundaries ``2 ** (k / 2**le_scale)`` ms
(``classic_bounds``) between ``2**min_exp2`` and ``2**max_exp2`` ms. When the device histogram's
scale is at least ``le_scale`` every exponential bucket lies inside one classic bucket, so the
conversion is exact and ``histogram_quantile``'s linear interpolation is off by at most
``2 ** (2 ** -le_scale) - 1`` of the true value (19 % at le_scale 2, 9 % at 3, 4.4 % at 4); a
coarser device bucket is counted in the classic bucket holding its upper end.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import ValidationError

from ..metrics.histogram import ExponentialHistogram, lower_boundary
from .fleet import DEFAULT_PREFIX, SeqTracker, split_device_topic
from .schema import Event, LatencyWindow, Reported, State

log = logging.getLogger(__name__)

HISTOGRAM = "edge_fleet_latency_ms"
MAX_HEALTH_KEYS = 64  # a device cannot blow up the exporter's cardinality through its health object


def classic_bounds(le_scale: int = 2, min_exp2: int = -2, max_exp2: int = 17) -> list[float]:
    """The ``le`` boundaries in ms: ``2 ** (k / 2**le_scale)`` from ``2**min_exp2`` to ``2**max_exp2``."""
    unit = 1 << le_scale
    return [lower_boundary(k, le_scale) for k in range(min_exp2 * unit, max_exp2 * unit + 1)]


def classic_counts(hist: ExponentialHistogram, bounds: list[float]) -> list[int]:
    """Per-``le`` (non-cumulative) counts of ``hist``, the last entry being ``+Inf``'s own share."""
    counts = [0] * (len(bounds) + 1)
    counts[0] += hist.zero_count
    for k, c in enumerate(hist.bucket_counts):
        if c:
            upper = lower_boundary(hist.offset + k + 1, hist.scale)  # the bucket is (lower, upper]
            counts[bisect_left(bounds, upper)] += c
    return counts


def _flat_numbers(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves of a JSON object as ``a_b_c`` names (booleans as 0/1); anything else is skipped."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flat_numbers(value, f"{prefix}_{key}" if prefix else str(key))
    elif isinstance(obj, (int, float)) and math.isfinite(obj):
        yield prefix, float(obj)


@dataclass
class ExportDevice:
    """One device as the exporter sees it: state, tiers, ``seq`` bookkeeping, cumulative histograms, health."""

    device_id: str
    online: float = math.nan
    tiers: dict[str, str] = field(default_factory=dict)
    seq: SeqTracker = field(default_factory=SeqTracker)
    hists: dict[tuple[str, str, str], ExponentialHistogram] = field(default_factory=dict)
    health: dict[str, float] = field(default_factory=dict)
    tier_switches: dict[str, int] = field(default_factory=dict)
    historical: int = 0
    last_window_wall: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class FleetStore:
    """Thread-safe store behind the exporter (see the module doc); ``ingest`` never raises."""

    def __init__(self, wall: Callable[[], float] = time.time, prefix: str = DEFAULT_PREFIX) -> None:
        self.wall = wall
        self.prefix = prefix
        self.devices: dict[str, ExportDevice] = {}
        self.messages: dict[str, int] = {}
        self.malformed = 0
        self.lag_s = ExponentialHistogram()  # publish (window end) -> ingested here, for the benchmark
        self._lock = threading.Lock()

    def ingest(self, topic: str, payload: bytes) -> None:
        """One MQTT message; a malformed one, or a topic outside ``prefix``, is counted in ``malformed``."""
        parsed = split_device_topic(topic, self.prefix)
        if parsed is None:
            with self._lock:
                self.malformed += 1
            log.debug("ignored %s: not a device topic under %s/<device>/", topic, self.prefix)
            return
        device_id, kind = parsed
        try:
            with self._lock:
                self.messages[kind] = self.messages.get(kind, 0) + 1
                self._ingest(device_id, kind, payload)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError and JSONDecodeError are ValueErrors
            self.malformed += 1
            log.warning("malformed message on %s: %s", topic, str(exc).splitlines()[0][:200])

    def _device(self, device_id: str) -> ExportDevice:
        dev = self.devices.get(device_id)
        if dev is None:
            dev = self.devices[device_id] = ExportDevice(device_id)
        return dev

    def _ingest(self, device_id: str, kind: str, payload: bytes) -> None:
        if not payload:  # a cleared retained message
            return
        if kind == "state":
            st = State.model_validate_json(payload)
            self._device(device_id).online = 1.0 if st.state != "offline" else 0.0
        elif kind == "reported":
            rep = Reported.model_validate_json(payload)
            self._device(device_id).tiers.update(rep.active_tiers)
        elif kind == "meta":
            data = json.loads(payload)
            if isinstance(data, dict):
                self._device(device_id).meta = {k: data[k] for k in ("version",) if isinstance(data.get(k), str)}
        elif kind == "tele/latency":
            self._window(device_id, payload)
        elif kind == "evt/tier_switch":
            ev = Event.model_validate_json(payload)
            workload = str(ev.data.get("workload", "llm"))[:32]
            dev = self._device(device_id)
            dev.tier_switches[workload] = dev.tier_switches.get(workload, 0) + 1

    def _window(self, device_id: str, payload: bytes) -> None:
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise ValueError("tele/latency: expected a JSON object")
        health = data.get("health")
        try:
            win = LatencyWindow.model_validate(data)
        except ValidationError:
            if "health" not in data:
                raise
            # A newer agent's window may carry fields this schema version does not know: the
            # histograms are what matters here, so read the rest without them.
            win = LatencyWindow.model_validate({k: v for k, v in data.items() if k != "health"})
        dev = self._device(device_id)
        if not dev.seq.add(win.seq):
            return  # a duplicate delivery: merged once already
        dev.last_window_wall = win.window.end_wall
        self.lag_s.record(max(0.0, self.wall() - win.window.end_wall))
        if isinstance(health, dict):
            dev.health = dict(list(_flat_numbers(health))[:MAX_HEALTH_KEYS])
        if win.historical:
            dev.historical += 1  # a replayed window still counts: the cumulative histogram wants every sample
        for s, raw in zip(win.series, data["series"]):
            dev.tiers.setdefault(s.workload, s.tier)
            if not win.historical:
                dev.tiers[s.workload] = s.tier
            for metric in s.histograms:
                # From the JSON the model has just validated: no second round trip through the model,
                # which is most of the ingest cost at a thousand windows a second.
                incoming = ExponentialHistogram.from_dict(raw["histograms"][metric])
                key = (s.workload, s.tier, metric)
                hist = dev.hists.get(key)
                if hist is None:
                    dev.hists[key] = incoming
                else:
                    hist.merge(incoming)

    def fleet_histogram(self, workload: str, metric: str) -> ExponentialHistogram | None:
        """Every device's cumulative histogram of ``metric`` merged: the reference for the fleet's quantiles."""
        merged: ExponentialHistogram | None = None
        with self._lock:
            for dev in self.devices.values():
                for (wl, _tier, m), h in dev.hists.items():
                    if wl == workload and m == metric:
                        if merged is None:
                            merged = h.copy()
                        else:
                            merged.merge(h)
        return merged

    def lag_quantiles(self, qs: tuple[float, ...]) -> dict[float, float]:
        """Quantiles (s) of the ingest lag over every window so far; empty before the first window."""
        with self._lock:
            return {q: v for q in qs if (v := self.lag_s.quantile(q)) is not None}

    def snapshot(self) -> list[ExportDevice]:
        """Copies of the devices, taken under the lock, for a scrape or an OTLP push."""
        with self._lock:
            return [
                ExportDevice(
                    d.device_id,
                    d.online,
                    dict(d.tiers),
                    d.seq,
                    {k: h.copy() for k, h in d.hists.items()},
                    dict(d.health),
                    dict(d.tier_switches),
                    d.historical,
                    d.last_window_wall,
                    dict(d.meta),
                )
                for d in self.devices.values()
            ]


class FleetCollector:
    """``prometheus_client`` custom collector over a ``FleetStore``: histograms, per-device gauges, own counters."""

    def __init__(self, store: FleetStore, le_scale: int = 2, min_exp2: int = -2, max_exp2: int = 17) -> None:
        self.store = store
        self.bounds = classic_bounds(le_scale, min_exp2, max_exp2)
        self._le = [repr(b) for b in self.bounds] + ["+Inf"]

    def collect(self) -> Iterator[Metric]:
        devices = self.store.snapshot()
        now = self.store.wall()
        hist = HistogramMetricFamily(
            HISTOGRAM,
            "latency per device, workload, tier and metric, merged from every window (ms)",
            labels=("device", "workload", "tier", "metric"),
        )
        online = GaugeMetricFamily("edge_fleet_device_online", "1 online, 0 offline (state topic)", labels=("device",))
        tier = GaugeMetricFamily(
            "edge_fleet_device_tier", "1 for the tier each workload runs now", labels=("device", "workload", "tier")
        )
        health = GaugeMetricFamily(
            "edge_fleet_device_health", "numeric leaves of the last window's health object", labels=("device", "name")
        )
        gaps = GaugeMetricFamily("edge_fleet_device_seq_gaps", "tele/latency seq numbers missing", labels=("device",))
        dups = CounterMetricFamily("edge_fleet_device_duplicate_windows", "windows delivered twice", labels=("device",))
        windows = CounterMetricFamily("edge_fleet_device_windows", "distinct windows received", labels=("device",))
        age = GaugeMetricFamily(
            "edge_fleet_device_last_window_age_seconds", "now minus the last window's end", labels=("device",)
        )
        switches = CounterMetricFamily(
            "edge_fleet_device_tier_switches", "evt/tier_switch events received", labels=("device", "workload")
        )
        for dev in sorted(devices, key=lambda d: d.device_id):
            d = dev.device_id
            for (workload, tier_name, metric), h in sorted(dev.hists.items()):
                cumulative, running = [], 0
                for le, c in zip(self._le, classic_counts(h, self.bounds)):
                    running += c
                    cumulative.append((le, running))
                hist.add_metric([d, workload, tier_name, metric], cumulative, h.sum)
            if not math.isnan(dev.online):
                online.add_metric([d], dev.online)
            for workload, tier_name in sorted(dev.tiers.items()):
                tier.add_metric([d, workload, tier_name], 1.0)
            for name, value in sorted(dev.health.items()):
                health.add_metric([d, name], value)
            gaps.add_metric([d], dev.seq.gaps)
            dups.add_metric([d], dev.seq.duplicates)
            windows.add_metric([d], dev.seq.received)
            if dev.last_window_wall is not None:
                age.add_metric([d], max(0.0, now - dev.last_window_wall))
            for workload, n in sorted(dev.tier_switches.items()):
                switches.add_metric([d, workload], n)
        yield from (hist, online, tier, health, gaps, dups, windows, age, switches)
        msgs = CounterMetricFamily("edge_fleet_export_messages", "MQTT messages ingested", labels=("kind",))
        for kind, n in sorted(self.store.messages.items()):
            msgs.add_metric([kind], n)
        yield msgs
        yield CounterMetricFamily("edge_fleet_export_malformed", "messages refused as malformed", self.store.malformed)
        lag = GaugeMetricFamily(
            "edge_fleet_export_ingest_lag_seconds",
            "window end on the device's wall clock to ingested here, over every window since start "
            "(includes the clock offset between the two hosts)",
            labels=("quantile",),
        )
        for q, value in self.store.lag_quantiles((0.5, 0.95, 0.99)).items():
            lag.add_metric([str(q)], value)
        yield lag


def subscriptions(prefix: str = "edge/v1", share_group: str | None = "edge-fleet-export") -> list[str]:
    """Windows and tier switches through an MQTT 5 shared subscription (exporters of one group split
    them); the retained state, reported and meta on plain subscriptions, so every exporter has all."""
    shared = [f"{prefix}/+/tele/latency", f"{prefix}/+/evt/tier_switch"]
    if share_group:
        shared = [f"$share/{share_group}/{t}" for t in shared]
    return [*shared, f"{prefix}/+/state", f"{prefix}/+/reported", f"{prefix}/+/meta"]


class MqttFeed:
    """A paho MQTT 5 client that feeds a ``FleetStore`` from ``subscriptions``; reconnects by itself."""

    def __init__(
        self,
        store: FleetStore,
        host: str,
        port: int,
        topics: list[str],
        client_id: str = "",
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        import paho.mqtt.client as mqtt

        self.store, self.topics = store, topics
        self.errors: list[str] = []
        self.connected = threading.Event()
        self.subscribed = threading.Event()  # the broker acknowledged the subscriptions
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.client.suppress_exceptions = True
        if username:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.on_message = lambda _c, _u, m: store.ingest(m.topic, bytes(m.payload))
        self.host, self.port = host, port

    def _on_connect(self, client: Any, _u: object, _f: object, rc: object, _p: object) -> None:
        if getattr(rc, "is_failure", False):
            self.errors.append(f"broker {self.host}:{self.port} refused the connection: {rc}")
            return
        client.subscribe([(t, 1) for t in self.topics])
        self.connected.set()

    def start(self) -> MqttFeed:
        self.client.connect(self.host, self.port, keepalive=20)
        self.client.loop_start()
        return self

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
