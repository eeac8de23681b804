"""The fleet view behind ``edge-agent fleet watch``: a live table from ``edge/v1/+/#``, with merged histograms.

Per device: online/offline (``state``, incl. the Last Will), active tier (from the latest window or the
retained ``reported``, whichever came last), TTFT P95/P99 read from the device's histograms merged over
the last ``window_s`` seconds of *live* windows, ASR first-partial and final P95, throughput, health (CPU
temperature, RSS, CPU % when windows carry ``health``), requests refused at admission (by reason and
class) and chats preempted by voice turns over the same windows (when windows carry ``admission``;
an older agent's windows show these columns absent), *stale* when no window came for more than
``STALE_INTERVALS`` times the device's window length, and ``seq`` bookkeeping: a duplicate
(at-least-once delivery) is counted and ignored, a missing number is a gap until a replayed
(``historical``) window fills it. The fleet row merges every device's
histograms (never averaging percentiles); its error bound is that of the merged histogram's scale.

``FleetView`` is pure (time injected, ``ingest`` never raises); the CLI (``cli/fleet.py``) wraps it in a
paho client. ``split_device_topic`` is the one place a fleet tool reads a device id out of a topic
(``fleet watch`` here, ``fleet export`` in ``fleet_export.py``), for a prefix of any number of levels.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..metrics.histogram import ExponentialHistogram
from .schema import Admission, Event, LatencyWindow, Reported, State

log = logging.getLogger(__name__)

MAX_MISSING = 100_000
MAX_WINDOWS_PER_DEVICE = 4096
STALE_INTERVALS = 3.0  # a device is stale after this many of its own window lengths without a window
ASR_METRICS = ("first_partial_ms", "final_ms")
DEFAULT_PREFIX = "edge/v1"
ADVISORY = ("health", "admission")  # window fields dropped, not the window, when this schema cannot read them


def split_device_topic(topic: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, str] | None:
    """``(device_id, rest)`` of ``<prefix>/<device_id>/<rest>``, or None for a topic outside ``prefix``.

    ``prefix`` has any number of levels (``acme/edge/v1`` as well as ``edge/v1``; ``mqtt.topic_prefix``
    and ``--prefix`` accept any), and a ``+`` level in it matches any one level, as in the subscription
    built from it. Levels are compared whole, so ``edge/v10/a/state`` is not under ``edge/v1``. The
    device id and ``rest`` are never empty; ``rest`` keeps its own levels (``tele/latency``,
    ``evt/tier_switch``). Every fleet tool that reads device topics calls this, so they agree on
    which messages belong to which device.
    """
    levels = topic.split("/")
    wanted = prefix.split("/")
    n = len(wanted)
    if len(levels) < n + 2:
        return None
    for got, want in zip(levels, wanted):
        if want != "+" and got != want:
            return None
    device_id, rest = levels[n], "/".join(levels[n + 1 :])
    if not device_id or not rest:
        return None
    return device_id, rest


class SeqTracker:
    """Gaps and duplicates of one device's ``seq`` stream (monotonic across its restarts)."""

    def __init__(self) -> None:
        self.high = 0
        self.missing: set[int] = set()
        self.duplicates = 0
        self.received = 0
        self.missing_overflow = 0

    def add(self, seq: int) -> bool:
        """True when ``seq`` is new (use the window), False for a duplicate."""
        if seq > self.high:
            if self.high:  # the first number seen is where this watch starts: nothing before it is a gap
                gap = range(self.high + 1, seq)
                if len(self.missing) + len(gap) > MAX_MISSING:
                    self.missing_overflow += len(gap)
                else:
                    self.missing.update(gap)
            self.high = seq
        elif seq in self.missing:
            self.missing.discard(seq)
        else:
            self.duplicates += 1
            return False
        self.received += 1
        return True

    @property
    def gaps(self) -> int:
        return len(self.missing) + self.missing_overflow


@dataclass
class DeviceView:
    """What the fleet view knows of one device: state, tiers, ``seq`` bookkeeping and recent live windows."""

    device_id: str
    state: str = "unknown"
    session: int | None = None
    tiers: dict[str, str] = field(default_factory=dict)
    seq: SeqTracker = field(default_factory=SeqTracker)
    # (received at, {metric: histogram}, requests, tokens, duration_s, admission) of live windows; the
    # histograms hold the watched workload's metrics plus the ASR metrics of the "asr" workload;
    # admission is the watched workload's refusals and preemptions (``AdmissionCounts``), None when the
    # window did not carry them
    windows: deque = field(default_factory=lambda: deque(maxlen=MAX_WINDOWS_PER_DEVICE))
    historical: int = 0
    events: dict[str, int] = field(default_factory=dict)
    last_seen: float | None = None
    interval_s: float | None = None  # the length of its last live window: how often it reports
    health: dict[str, float | None] = field(default_factory=dict)


class FleetView:
    """The fleet's live table from MQTT (see the module doc): pure, time injected, ``ingest`` never raises."""

    def __init__(
        self,
        window_s: float = 60.0,
        metric: str = "ttft_ms",
        workload: str = "llm",
        clock: Callable[[], float] = time.monotonic,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.window_s, self.metric, self.workload, self.clock = window_s, metric, workload, clock
        self.prefix = prefix
        self.devices: dict[str, DeviceView] = {}
        self.malformed = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def ingest(self, topic: str, payload: bytes) -> None:
        """One MQTT message. Malformed payloads, and topics outside ``prefix``, are counted (``malformed``)
        and described, never raised."""
        parsed = split_device_topic(topic, self.prefix)
        if parsed is None:
            with self._lock:
                self.malformed += 1
                self.last_error = f"{topic[:200]}: not a device topic under {self.prefix}/<device>/"
            log.debug("ignored %s: not a device topic under %s/<device>/", topic, self.prefix)
            return
        device_id, kind = parsed
        try:
            with self._lock:
                self._ingest(device_id, kind, payload)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            self.malformed += 1
            self.last_error = f"{topic}: {str(exc).splitlines()[0][:200]}"
            log.warning("malformed message on %s: %s", topic, exc)

    def _device(self, device_id: str) -> DeviceView:
        dev = self.devices.get(device_id)
        if dev is None:
            dev = self.devices[device_id] = DeviceView(device_id)
        return dev

    def _ingest(self, device_id: str, kind: str, payload: bytes) -> None:
        if kind == "state":
            if not payload:
                return
            st = State.model_validate_json(payload)
            dev = self._device(device_id)
            dev.state, dev.session = st.state, st.session
        elif kind == "reported":
            if not payload:
                return
            rep = Reported.model_validate_json(payload)
            self._device(device_id).tiers.update(rep.active_tiers)
        elif kind == "tele/latency":
            raw = json.loads(payload)
            if not isinstance(raw, dict):
                raise ValueError("a window must be a JSON object")
            health = raw.get("health")
            try:
                win = LatencyWindow.model_validate(raw)
            except ValueError:
                # Health and admission are advisory: a window whose health or counts this schema cannot
                # read still counts its latency (those columns show absent).
                if not [raw.pop(k) for k in ADVISORY if k in raw]:
                    raise
                win = LatencyWindow.model_validate(raw)
            dev = self._device(device_id)
            dev.last_seen = self.clock()
            if not dev.seq.add(win.seq):
                return
            if win.historical:
                dev.historical += 1
                return
            dev.interval_s = win.window.duration_s or dev.interval_s
            dev.health = health_columns(health)
            hists: dict[str, ExponentialHistogram] = {}
            requests = tokens = 0
            for s in win.series:
                dev.tiers[s.workload] = s.tier
                watched = s.workload == self.workload
                if watched:
                    requests += s.requests
                    tokens += s.tokens_out
                for metric, h in s.histograms.items():
                    keys: list[str] = [metric] if watched else []
                    if s.workload == "asr" and metric in ASR_METRICS:
                        keys.append(f"asr.{metric}")
                    for key in keys:
                        hist = h.to_histogram()
                        if key in hists:
                            hists[key].merge(hist)
                        else:
                            hists[key] = hist
            admission = None if win.admission is None else AdmissionCounts.of(win.admission, self.workload)
            dev.windows.append((self.clock(), hists, requests, tokens, win.window.duration_s, admission))
        elif kind.startswith("evt/"):
            ev = Event.model_validate_json(payload)
            dev = self._device(device_id)
            dev.events[ev.type] = dev.events.get(ev.type, 0) + 1

    # -- views ------------------------------------------------------------------------------------

    def _recent(self, dev: DeviceView, now: float) -> tuple[ExponentialHistogram | None, float, float]:
        requests = tokens = 0
        duration = 0.0
        for at, _hists, req, tok, dur, _adm in dev.windows:
            if now - at <= self.window_s:
                requests, tokens, duration = requests + req, tokens + tok, duration + dur
        merged = self._merged(dev, now, self.metric)
        return merged, (requests / duration if duration else 0.0), (tokens / duration if duration else 0.0)

    def _merged(self, dev: DeviceView, now: float, key: str) -> ExponentialHistogram | None:
        merged: ExponentialHistogram | None = None
        for at, hists, _req, _tok, _dur, _adm in dev.windows:
            h = hists.get(key) if now - at <= self.window_s else None
            if h is not None:
                if merged is None:
                    merged = h.copy()
                else:
                    merged.merge(h)
        return merged

    def _admission(self, dev: DeviceView, now: float) -> AdmissionCounts | None:
        """The watched workload's refusals and preemptions summed over the recent windows; None when
        none of them carried the counts (an agent that does not report them)."""
        total: AdmissionCounts | None = None
        for at, _hists, _req, _tok, _dur, adm in dev.windows:
            if adm is not None and now - at <= self.window_s:
                total = (total or AdmissionCounts()).add(adm)
        return total

    def _stale(self, dev: DeviceView, now: float) -> bool:
        # Only a device whose cadence is known can be late; one that said "offline" is not stale, it is gone.
        if dev.last_seen is None or not dev.interval_s or dev.state == "offline":
            return False
        return now - dev.last_seen > STALE_INTERVALS * dev.interval_s

    def rows(self) -> dict[str, Any]:
        now = self.clock()
        out = []
        fleet: ExponentialHistogram | None = None
        fleet_rps = fleet_tps = 0.0
        fleet_adm: AdmissionCounts | None = None
        with self._lock:
            for dev in sorted(self.devices.values(), key=lambda d: d.device_id):
                hist, rps, tps = self._recent(dev, now)
                if hist is not None:
                    if fleet is None:
                        fleet = hist.copy()
                    else:
                        fleet.merge(hist)
                fleet_rps, fleet_tps = fleet_rps + rps, fleet_tps + tps
                asr = {m: _p95(self._merged(dev, now, f"asr.{m}")) for m in ASR_METRICS}
                adm = self._admission(dev, now)
                if adm is not None:
                    fleet_adm = (fleet_adm or AdmissionCounts()).add(adm)
                seen = None if dev.last_seen is None else round(now - dev.last_seen, 3)
                out.append(
                    {
                        "device": dev.device_id,
                        "state": dev.state,
                        "session": dev.session,
                        "stale": self._stale(dev, now),
                        "last_window_age_s": seen,
                        "interval_s": None if dev.interval_s is None else round(dev.interval_s, 3),
                        "tier": dev.tiers.get(self.workload),
                        "tiers": dict(dev.tiers),
                        **_quantiles(hist),
                        "asr_first_partial_p95_ms": asr["first_partial_ms"],
                        "asr_final_p95_ms": asr["final_ms"],
                        "cpu_temp_c": dev.health.get("cpu_temp_c"),
                        "rss_mb": dev.health.get("rss_mb"),
                        "cpu_percent": dev.health.get("cpu_percent"),
                        "requests_per_s": round(rps, 3),
                        "tokens_per_s": round(tps, 3),
                        **AdmissionCounts.columns(adm),
                        "windows": dev.seq.received,
                        "historical": dev.historical,
                        "gaps": dev.seq.gaps,
                        "duplicates": dev.seq.duplicates,
                        "seq_high": dev.seq.high,
                        "events": dict(dev.events),
                    }
                )
        online = sum(1 for r in out if r["state"] == "online")
        fleet_row = {
            "devices": len(out),
            "online": online,
            "stale": sum(1 for r in out if r["stale"]),
            **_quantiles(fleet),
            "requests_per_s": round(fleet_rps, 3),
            "tokens_per_s": round(fleet_tps, 3),
            **AdmissionCounts.columns(fleet_adm),
            "gaps": sum(r["gaps"] for r in out),
            "duplicates": sum(r["duplicates"] for r in out),
        }
        return {
            "metric": self.metric,
            "window_s": self.window_s,
            "devices": out,
            "fleet": fleet_row,
            "malformed": self.malformed,
            "last_error": self.last_error,
        }

    def fleet_histogram(self) -> ExponentialHistogram | None:
        now = self.clock()
        merged: ExponentialHistogram | None = None
        with self._lock:
            for dev in self.devices.values():
                h, _r, _t = self._recent(dev, now)
                if h is None:
                    continue
                if merged is None:
                    merged = h.copy()
                else:
                    merged.merge(h)
        return merged


@dataclass
class AdmissionCounts:
    """One workload's refusals (in all, by reason, by class) and preemptions, over one or more windows."""

    refused: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    by_class: dict[str, int] = field(default_factory=dict)
    preempted: int = 0

    @classmethod
    def of(cls, admission: Admission, workload: str) -> AdmissionCounts:
        out = cls(preempted=admission.preempted.get(workload, 0))
        for r in admission.refused:
            if r.workload == workload:
                out.refused += r.count
                out.by_reason[r.reason] = out.by_reason.get(r.reason, 0) + r.count
                out.by_class[r.class_] = out.by_class.get(r.class_, 0) + r.count
        return out

    def add(self, other: AdmissionCounts) -> AdmissionCounts:
        self.refused += other.refused
        self.preempted += other.preempted
        for mine, theirs in ((self.by_reason, other.by_reason), (self.by_class, other.by_class)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        return self

    @staticmethod
    def columns(counts: AdmissionCounts | None) -> dict[str, Any]:
        """The row's columns: None throughout when no window carried the counts."""
        if counts is None:
            return {"refused": None, "refused_by_reason": None, "refused_by_class": None, "preempted": None}
        return {
            "refused": counts.refused,
            "refused_by_reason": dict(sorted(counts.by_reason.items())),
            "refused_by_class": dict(sorted(counts.by_class.items())),
            "preempted": counts.preempted,
        }


def _quantiles(hist: ExponentialHistogram | None) -> dict[str, Any]:
    if hist is None or hist.count == 0:
        return {"p95_ms": None, "p99_ms": None, "count": 0, "relative_error": None}
    p95, p99 = hist.quantile(0.95), hist.quantile(0.99)  # never None: the histogram holds samples
    return {
        "p95_ms": None if p95 is None else round(p95, 3),
        "p99_ms": None if p99 is None else round(p99, 3),
        "count": hist.count,
        "relative_error": round(hist.relative_error, 5),
    }


def _p95(hist: ExponentialHistogram | None) -> float | None:
    q = hist.quantile(0.95) if hist is not None and hist.count else None
    return None if q is None else round(q, 3)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _first(obj: Any, *paths: str) -> float | None:
    """The first number found at one of the dotted ``paths`` of ``obj``; None when none is there."""
    for path in paths:
        cur = obj
        for part in path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if _number(cur) is not None:
            return _number(cur)
    return None


def _hottest(temps: Any) -> float | None:
    """The highest reading among temperature sources: a number, a list or a mapping of them (or of objects)."""
    if isinstance(temps, dict):
        temps = list(temps.values())
    if not isinstance(temps, list):
        return _number(temps)
    found = [
        t
        for t in (_number(v) if not isinstance(v, dict) else _first(v, "temp_c", "c", "value") for v in temps)
        if t is not None
    ]
    return max(found) if found else None


def health_columns(health: Any) -> dict[str, float | None]:
    """CPU temperature (°C), RSS (MiB) and process CPU % from a window's ``health``, None for what is absent.

    Read defensively: every source of ``health`` is optional on the device, and a malformed or missing
    object shows as absent columns rather than a refused window.
    """
    if not isinstance(health, dict):
        return {}
    temp = _first(health, "max_temp_c", "cpu_temp_c", "temp_c")
    if temp is None:
        temp = _hottest(health.get("temperatures_c", health.get("temperatures", health.get("thermal"))))
    rss_mb = _first(health, "process.rss_mb", "rss_mb")
    if rss_mb is None:
        rss = _first(health, "process_rss_bytes", "process.rss_bytes", "rss_bytes")
        rss_mb = None if rss is None else rss / 2**20
    cpu = _first(health, "process_cpu_percent", "process.cpu_percent", "cpu_percent")
    return {
        "cpu_temp_c": None if temp is None else round(temp, 1),
        "rss_mb": None if rss_mb is None else round(rss_mb, 1),
        "cpu_percent": None if cpu is None else round(cpu, 1),
    }


def render_table(view: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    m = view["metric"].removesuffix("_ms").upper()
    head = (
        f"{'DEVICE':<20} {'STATE':<8} {'TIER':<8} {m + ' P95':>9} {m + ' P99':>9} {'N':>6} "
        f"{'REQ/S':>7} {'TOK/S':>8} {'GAPS':>5} {'DUPS':>5} {'ASR1P95':>8} {'FINP95':>8} "
        f"{'TEMP':>6} {'RSS MB':>7} {'CPU%':>6} {'REFUSED':>7} {'PREEMPT':>7}"
    )
    lines = [head]
    for r in view["devices"]:
        state = "stale" if r["stale"] else r["state"]
        lines.append(
            f"{r['device'][:20]:<20} {state:<8} {f(r['tier'])[:8]:<8} {f(r['p95_ms']):>9} "
            f"{f(r['p99_ms']):>9} {r['count']:>6} {r['requests_per_s']:>7.2f} {r['tokens_per_s']:>8.1f} "
            f"{r['gaps']:>5} {r['duplicates']:>5} {f(r['asr_first_partial_p95_ms']):>8} "
            f"{f(r['asr_final_p95_ms']):>8} {f(r['cpu_temp_c']):>6} {f(r['rss_mb']):>7} "
            f"{f(r['cpu_percent']):>6} {f(r['refused']):>7} {f(r['preempted']):>7}"
        )
    fl = view["fleet"]
    err = f" (±{fl['relative_error'] * 100:.1f} %)" if fl["relative_error"] is not None else ""
    lines.append(
        f"{'FLEET (' + str(fl['online']) + '/' + str(fl['devices']) + ' online)':<29} "
        f"{f(fl['p95_ms']):>9} {f(fl['p99_ms']):>9} {fl['count']:>6} {fl['requests_per_s']:>7.2f} "
        f"{fl['tokens_per_s']:>8.1f} {fl['gaps']:>5} {fl['duplicates']:>5}{err}"
    )
    if fl["refused"]:
        reasons = ", ".join(f"{k} {n}" for k, n in fl["refused_by_reason"].items())
        classes = ", ".join(f"{k} {n}" for k, n in fl["refused_by_class"].items())
        lines.append(f"refused {fl['refused']} in the last {view['window_s']:g} s: {reasons} (class: {classes})")
    if fl["stale"]:
        lines.append(f"{fl['stale']} device(s) stale: no window for more than {STALE_INTERVALS:g} intervals")
    if view["malformed"]:
        lines.append(f"{view['malformed']} malformed messages ignored; last: {view['last_error']}")
    return "\n".join(lines)
