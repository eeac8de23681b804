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

Bounded (``ExportLimits``, the ``--max-*`` and ``--stale-after-s`` flags): a window passes the schema
with 256 series of new tier names, or histograms of 4,096 buckets, and every cumulative histogram is
rendered as ~80 classic series at every scrape, so without bounds one device could make ``/metrics``
too large to scrape for the whole fleet. Per device the series (workload × tier × metric) are capped,
per histogram the buckets (downscaled on arrival, counts exact), the devices are capped, idle series
and devices expire; what is refused is counted by reason with bounded labels and logged once.
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
from itertools import islice
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import ValidationError

from ..metrics.histogram import DEFAULT_MAX_SIZE, MIN_MAX_SIZE, ExponentialHistogram, lower_boundary
from .fleet import ADVISORY, DEFAULT_PREFIX, SeqTracker, split_device_topic
from .schema import Event, LatencyWindow, Reported, State

log = logging.getLogger(__name__)

HISTOGRAM = "edge_fleet_latency_ms"
MAX_HEALTH_KEYS = 64  # a device cannot blow up the exporter's cardinality through its health object
MAX_WORKLOADS = 16  # workloads per device in the tier gauge and the tier-switch counter
MAX_REFUSAL_LABELS = 64  # (workload, reason, class) label sets per device in the refused-requests counter
MAX_LABEL = 64  # characters of a tier, workload or version label taken from a payload
MAX_DEVICE_ID = 128  # a longer device id (the topic level) would be repeated in every one of its samples
LOG_EVERY_S = 600.0  # a store-wide refusal reason is logged at most this often (the counter has every one)
MAX_SWEEP_EVERY_S = 60.0
# edge_fleet_refused_total{reason}: a fixed set, so the counter's own labels stay bounded.
REFUSAL_REASONS = ("device_limit", "device_id", "series_limit", "workload_limit")
KINDS = frozenset({"tele/latency", "evt/tier_switch", "state", "reported", "meta"})


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


@dataclass(frozen=True)
class ExportLimits:
    """What one device (or a flood of device ids) can make the exporter hold and render.

    Every bound is per exporter process; what goes over one is refused, counted in
    ``edge_fleet_refused_total{reason}`` and logged once, and nothing already held changes:

    - ``max_devices``: devices held at once; a message from a new device beyond it is refused
      (``device_limit``) until an idle device expires;
    - ``max_series_per_device``: cumulative histograms (workload × tier × metric) per device; a new
      series beyond it is refused (``series_limit``) while the device's other series keep merging;
    - ``max_buckets``: buckets per stored histogram; a finer one is downscaled on arrival (counts,
      sum, min and max stay exact, only resolution goes) and counted in
      ``edge_fleet_histograms_downscaled_total``;
    - ``stale_after_s``: a series not merged into, and a device not heard from, for this long is
      dropped (0: never), so tier names a device stopped using free their room.

    So one device costs the scrape at most ``max_series_per_device`` histograms of at most
    ``max_buckets`` buckets, and the fleet at most ``max_devices`` such devices.
    """

    max_devices: int = 10_000
    max_series_per_device: int = 64
    max_buckets: int = DEFAULT_MAX_SIZE
    stale_after_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_devices < 1:
            raise ValueError(f"max_devices must be >= 1, got {self.max_devices}")
        if self.max_series_per_device < 1:
            raise ValueError(f"max_series_per_device must be >= 1, got {self.max_series_per_device}")
        if self.max_buckets < MIN_MAX_SIZE:
            raise ValueError(f"max_buckets must be >= {MIN_MAX_SIZE}, got {self.max_buckets}")
        if not self.stale_after_s >= 0 or math.isinf(self.stale_after_s):
            raise ValueError(f"stale_after_s must be a finite number >= 0, got {self.stale_after_s}")


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
    heard: float = 0.0  # the store's clock when any message of this device last arrived
    merged_at: dict[tuple[str, str, str], float] = field(default_factory=dict)  # per series, for expiry
    refused_series: int = 0  # series refused over max_series_per_device (a counter with a device label)
    # windows' ``admission`` summed: (workload, reason, class) -> requests refused, workload -> preemptions
    refused_requests: dict[tuple[str, str, str], int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)


class FleetStore:
    """Thread-safe store behind the exporter (see the module doc); ``ingest`` never raises.

    Bounded by ``limits`` (``ExportLimits``): a device that floods windows of new tier names, or
    histograms of thousands of buckets, or a flood of device ids, costs at most those bounds, and the
    series of devices within them are never touched by it. ``clock`` (monotonic) times expiry;
    ``wall`` only the ingest lag and window ages.
    """

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        prefix: str = DEFAULT_PREFIX,
        limits: ExportLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wall, self.clock = wall, clock
        self.prefix = prefix
        self.limits = limits or ExportLimits()
        self.devices: dict[str, ExportDevice] = {}
        self.messages: dict[str, int] = {}
        self.malformed = 0
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self.expired: dict[str, int] = {"series": 0, "devices": 0}
        self.downscaled = 0
        self.lag_s = ExponentialHistogram()  # publish (window end) -> ingested here, for the benchmark
        self._lock = threading.Lock()
        self._swept = clock()
        self._logged: dict[str, float] = {}  # reason -> when last logged (store-wide refusals, rate-limited)

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
                # Topics are subscribed by kind, but a plain feed may bring anything: the counter's
                # label stays one of the known kinds.
                label = kind if kind in KINDS else "other"
                self.messages[label] = self.messages.get(label, 0) + 1
                self._maybe_expire(self.clock())
                self._ingest(device_id, kind, payload)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError and JSONDecodeError are ValueErrors
            self.malformed += 1
            log.warning("malformed message on %s: %s", topic[:200], str(exc).splitlines()[0][:200])

    def _refuse(self, reason: str, detail: str) -> None:
        """Count one refusal; log it when this reason was not logged in the last ``LOG_EVERY_S``."""
        self.refused[reason] += 1
        now = self.clock()
        last = self._logged.get(reason)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning(
                "fleet export refused %s (%d refused for %s so far; edge_fleet_refused_total{reason=%r})",
                detail,
                self.refused[reason],
                reason,
                reason,
            )

    def _device(self, device_id: str) -> ExportDevice | None:
        """The device, created if there is room; None (refused and counted) when there is not."""
        dev = self.devices.get(device_id)
        if dev is None:
            if len(device_id) > MAX_DEVICE_ID:
                self._refuse("device_id", f"a device id of {len(device_id)} characters (at most {MAX_DEVICE_ID})")
                return None
            if len(self.devices) >= self.limits.max_devices:
                self._refuse(
                    "device_limit", f"device {device_id[:64]!r}: {self.limits.max_devices} devices are held already"
                )
                return None
            dev = self.devices[device_id] = ExportDevice(device_id)
        dev.heard = self.clock()
        return dev

    def _set_tier(self, dev: ExportDevice, workload: str, tier: str, replace: bool = True) -> None:
        """Record ``workload``'s tier, within ``MAX_WORKLOADS`` workloads per device."""
        workload, tier = workload[:MAX_LABEL], tier[:MAX_LABEL]  # `reported` does not bound its names
        if workload not in dev.tiers and len(dev.tiers) >= MAX_WORKLOADS:
            self._refuse("workload_limit", f"workload {workload[:32]!r} of {dev.device_id!r}: {MAX_WORKLOADS} held")
            return
        if replace or workload not in dev.tiers:
            dev.tiers[workload] = tier

    def _ingest(self, device_id: str, kind: str, payload: bytes) -> None:
        if not payload:  # a cleared retained message
            return
        if kind == "state":
            st = State.model_validate_json(payload)
            if (dev := self._device(device_id)) is not None:
                dev.online = 1.0 if st.state != "offline" else 0.0
        elif kind == "reported":
            rep = Reported.model_validate_json(payload)
            if (dev := self._device(device_id)) is not None:
                for workload, tier in rep.active_tiers.items():
                    self._set_tier(dev, workload, tier)
        elif kind == "meta":
            data = json.loads(payload)
            if isinstance(data, dict) and (dev := self._device(device_id)) is not None:
                dev.meta = {k: data[k][:MAX_LABEL] for k in ("version",) if isinstance(data.get(k), str)}
        elif kind == "tele/latency":
            self._window(device_id, payload)
        elif kind == "evt/tier_switch":
            ev = Event.model_validate_json(payload)
            workload = str(ev.data.get("workload", "llm"))[:32]
            if (dev := self._device(device_id)) is None:
                return
            if workload not in dev.tier_switches and len(dev.tier_switches) >= MAX_WORKLOADS:
                self._refuse("workload_limit", f"tier switches of {workload!r} on {device_id!r}: {MAX_WORKLOADS} held")
                return
            dev.tier_switches[workload] = dev.tier_switches.get(workload, 0) + 1

    def _window(self, device_id: str, payload: bytes) -> None:
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise ValueError("tele/latency: expected a JSON object")
        health = data.get("health")
        try:
            win = LatencyWindow.model_validate(data)
        except ValidationError:
            if not any(k in data for k in ADVISORY):
                raise
            # A newer agent's window may carry fields this schema version does not know: the
            # histograms are what matters here, so read the rest without them.
            win = LatencyWindow.model_validate({k: v for k, v in data.items() if k not in ADVISORY})
        dev = self._device(device_id)
        if dev is None:
            return  # refused and counted: no room for another device
        if not dev.seq.add(win.seq):
            return  # a duplicate delivery: merged once already
        now = dev.heard
        dev.last_window_wall = win.window.end_wall
        self.lag_s.record(max(0.0, self.wall() - win.window.end_wall))
        if isinstance(health, dict):
            dev.health = dict(islice(_flat_numbers(health), MAX_HEALTH_KEYS))
        if win.historical:
            dev.historical += 1  # a replayed window still counts: the cumulative histogram wants every sample
        if win.admission is not None:
            self._admission(device_id, dev, win.admission)
        limit = self.limits.max_series_per_device
        for s, raw in zip(win.series, data["series"]):
            self._set_tier(dev, s.workload, s.tier, replace=not win.historical)
            for metric in s.histograms:
                key = (s.workload, s.tier, metric)
                hist = dev.hists.get(key)
                if hist is None and len(dev.hists) >= limit:
                    dev.refused_series += 1
                    if dev.refused_series == 1:  # once per device, not per window: the counters say the rest
                        log.warning(
                            "device %r is over its bound of %d series (workload x tier x metric): new series "
                            "such as %s are refused (edge_fleet_device_refused_series_total); its %d series "
                            "and every other device's keep merging",
                            device_id,
                            limit,
                            "/".join(key),
                            len(dev.hists),
                        )
                    self.refused["series_limit"] += 1
                    continue
                # From the JSON the model has just validated: no second round trip through the model,
                # which is most of the ingest cost at a thousand windows a second. At most max_buckets
                # buckets: a finer histogram is downscaled here, exactly as the OTel SDK does it.
                wire = raw["histograms"][metric]
                incoming = ExponentialHistogram.from_dict(wire, max_size=self.limits.max_buckets)
                if incoming.scale < s.histograms[metric].scale:
                    self.downscaled += 1
                if hist is None:
                    dev.hists[key] = incoming
                else:
                    hist.merge(incoming)
                dev.merged_at[key] = now

    def _admission(self, device_id: str, dev: ExportDevice, admission: Any) -> None:
        """A window's refusals and preemptions added to the device's counters (bounded label sets)."""
        for r in admission.refused:
            key = (r.workload, r.reason, r.class_)
            if key not in dev.refused_requests and len(dev.refused_requests) >= MAX_REFUSAL_LABELS:
                self._refuse("workload_limit", f"refusals {'/'.join(key)} on {device_id!r}: {MAX_REFUSAL_LABELS} held")
                continue
            dev.refused_requests[key] = dev.refused_requests.get(key, 0) + r.count
        for workload, n in admission.preempted.items():
            if workload not in dev.preemptions and len(dev.preemptions) >= MAX_WORKLOADS:
                self._refuse("workload_limit", f"preemptions of {workload!r} on {device_id!r}: {MAX_WORKLOADS} held")
                continue
            dev.preemptions[workload] = dev.preemptions.get(workload, 0) + n

    def _maybe_expire(self, now: float) -> None:
        """Drop series and devices idle for ``stale_after_s``; a sweep at most every ``stale_after_s / 8``."""
        stale = self.limits.stale_after_s
        if not stale or now - self._swept < min(stale / 8, MAX_SWEEP_EVERY_S):
            return
        self._swept = now
        for device_id, dev in list(self.devices.items()):
            if now - dev.heard > stale:
                del self.devices[device_id]
                self.expired["devices"] += 1
                self.expired["series"] += len(dev.hists)
                continue
            for key, at in list(dev.merged_at.items()):
                if now - at > stale:
                    del dev.hists[key], dev.merged_at[key]
                    self.expired["series"] += 1

    def expire(self) -> None:
        """Run the expiry sweep now (the store also runs it from ``ingest`` and ``snapshot``)."""
        with self._lock:
            self._swept = -math.inf
            self._maybe_expire(self.clock())

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
        """Copies of the devices, taken under the lock, for a scrape or an OTLP push (stale ones expired first)."""
        with self._lock:
            self._maybe_expire(self.clock())
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
                    heard=d.heard,
                    refused_series=d.refused_series,
                    refused_requests=dict(d.refused_requests),
                    preemptions=dict(d.preemptions),
                )
                for d in self.devices.values()
            ]

    def counters(self) -> dict[str, dict[str, int]]:
        """The store's own counters, read under the lock: ``refused`` by reason, ``expired``, ``downscaled``."""
        with self._lock:
            return {
                "refused": dict(self.refused),
                "expired": dict(self.expired),
                "downscaled": {"histograms": self.downscaled},
            }


@dataclass
class _DeviceFamilies:
    """The per-device metric families of one scrape, in the order they are exposed."""

    hist: HistogramMetricFamily
    online: GaugeMetricFamily
    tier: GaugeMetricFamily
    health: GaugeMetricFamily
    gaps: GaugeMetricFamily
    dups: CounterMetricFamily
    windows: CounterMetricFamily
    age: GaugeMetricFamily
    switches: CounterMetricFamily
    over: CounterMetricFamily
    refused_requests: CounterMetricFamily
    preemptions: CounterMetricFamily

    @classmethod
    def empty(cls) -> _DeviceFamilies:
        return cls(
            hist=HistogramMetricFamily(
                HISTOGRAM,
                "latency per device, workload, tier and metric, merged from every window (ms)",
                labels=("device", "workload", "tier", "metric"),
            ),
            online=GaugeMetricFamily(
                "edge_fleet_device_online", "1 online, 0 offline (state topic)", labels=("device",)
            ),
            tier=GaugeMetricFamily(
                "edge_fleet_device_tier", "1 for the tier each workload runs now", labels=("device", "workload", "tier")
            ),
            health=GaugeMetricFamily(
                "edge_fleet_device_health",
                "numeric leaves of the last window's health object",
                labels=("device", "name"),
            ),
            gaps=GaugeMetricFamily(
                "edge_fleet_device_seq_gaps", "tele/latency seq numbers missing", labels=("device",)
            ),
            dups=CounterMetricFamily(
                "edge_fleet_device_duplicate_windows", "windows delivered twice", labels=("device",)
            ),
            windows=CounterMetricFamily("edge_fleet_device_windows", "distinct windows received", labels=("device",)),
            age=GaugeMetricFamily(
                "edge_fleet_device_last_window_age_seconds", "now minus the last window's end", labels=("device",)
            ),
            switches=CounterMetricFamily(
                "edge_fleet_device_tier_switches", "evt/tier_switch events received", labels=("device", "workload")
            ),
            over=CounterMetricFamily(
                "edge_fleet_device_refused_series",
                "series refused from a device over --max-series-per-device (only devices that went over)",
                labels=("device",),
            ),
            refused_requests=CounterMetricFamily(
                "edge_fleet_device_requests_refused",
                "requests refused at admission, from the windows' admission",
                labels=("device", "workload", "reason", "class"),
            ),
            preemptions=CounterMetricFamily(
                "edge_fleet_device_preemptions",
                "running requests that gave their row to a voice turn, from the windows' admission",
                labels=("device", "workload"),
            ),
        )

    def all(self) -> tuple[Metric, ...]:
        return (
            self.hist, self.online, self.tier, self.health, self.gaps, self.dups, self.windows, self.age,
            self.switches, self.over, self.refused_requests, self.preemptions,
        )  # fmt: skip


class FleetCollector:
    """``prometheus_client`` custom collector over a ``FleetStore``: histograms, per-device gauges, own counters."""

    def __init__(self, store: FleetStore, le_scale: int = 2, min_exp2: int = -2, max_exp2: int = 17) -> None:
        self.store = store
        self.bounds = classic_bounds(le_scale, min_exp2, max_exp2)
        self._le = [repr(b) for b in self.bounds] + ["+Inf"]

    def collect(self) -> Iterator[Metric]:
        devices = self.store.snapshot()
        now = self.store.wall()
        families = _DeviceFamilies.empty()
        for dev in sorted(devices, key=lambda d: d.device_id):
            self._add_device(families, dev, now)
        yield from families.all()
        yield from self._store_metrics()

    def _add_device(self, fam: _DeviceFamilies, dev: ExportDevice, now: float) -> None:
        """One device's samples into the scrape's families."""
        d = dev.device_id
        for (workload, tier_name, metric), h in sorted(dev.hists.items()):
            cumulative, running = [], 0
            for le, c in zip(self._le, classic_counts(h, self.bounds)):
                running += c
                cumulative.append((le, running))
            fam.hist.add_metric([d, workload, tier_name, metric], cumulative, h.sum)
        if not math.isnan(dev.online):
            fam.online.add_metric([d], dev.online)
        for workload, tier_name in sorted(dev.tiers.items()):
            fam.tier.add_metric([d, workload, tier_name], 1.0)
        for name, value in sorted(dev.health.items()):
            fam.health.add_metric([d, name], value)
        fam.gaps.add_metric([d], dev.seq.gaps)
        fam.dups.add_metric([d], dev.seq.duplicates)
        fam.windows.add_metric([d], dev.seq.received)
        if dev.last_window_wall is not None:
            fam.age.add_metric([d], max(0.0, now - dev.last_window_wall))
        for workload, n in sorted(dev.tier_switches.items()):
            fam.switches.add_metric([d, workload], n)
        if dev.refused_series:
            fam.over.add_metric([d], dev.refused_series)
        for (workload, reason, klass), n in sorted(dev.refused_requests.items()):
            fam.refused_requests.add_metric([d, workload, reason, klass], n)
        for workload, n in sorted(dev.preemptions.items()):
            fam.preemptions.add_metric([d, workload], n)

    def _store_metrics(self) -> Iterator[Metric]:
        """The exporter's own counters: messages, malformed, refused, expired, downscaled, ingest lag."""
        msgs = CounterMetricFamily("edge_fleet_export_messages", "MQTT messages ingested", labels=("kind",))
        for kind, n in sorted(self.store.messages.items()):
            msgs.add_metric([kind], n)
        yield msgs
        yield CounterMetricFamily("edge_fleet_export_malformed", "messages refused as malformed", self.store.malformed)
        counters = self.store.counters()
        refused = CounterMetricFamily(
            "edge_fleet_refused", "what the exporter's bounds refused (ExportLimits), by reason", labels=("reason",)
        )
        for reason, n in sorted(counters["refused"].items()):
            refused.add_metric([reason], n)
        yield refused
        expired = CounterMetricFamily(
            "edge_fleet_expired", "series and devices dropped after --stale-after-s idle", labels=("what",)
        )
        for what, n in sorted(counters["expired"].items()):
            expired.add_metric([what], n)
        yield expired
        yield CounterMetricFamily(
            "edge_fleet_histograms_downscaled",
            "window histograms over --max-buckets, downscaled on arrival",
            counters["downscaled"]["histograms"],
        )
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
