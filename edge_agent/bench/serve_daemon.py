"""What the daemon itself reported for a ``bench serve`` window: its ``/metrics`` histograms scraped
before and after (the difference holds exactly the window's requests), or its MQTT ``tele/latency``
windows.

Prometheus histograms keep fixed buckets, so a percentile read from their difference is an estimate:
linear interpolation inside the bucket that holds the rank (PromQL's ``histogram_quantile``), given
with that bucket's bounds (``lo``, ``hi``); the true value lies within them. Counts and the mean
(``_sum`` / ``_count``) are exact.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from ..errors import InputError
from ..metrics.histogram import ExponentialHistogram

PREFIX = "edge_agent:"
# bench metric name -> the daemon's Prometheus histogram (metrics/prometheus.py)
HISTOGRAMS = {
    "ttft_ms": "time_to_first_token_seconds",
    "itl_ms": "inter_token_latency_seconds",
    "tpot_ms": "time_per_output_token_seconds",
    "e2e_ms": "e2e_request_latency_seconds",
    "queue_ms": "request_queue_time_seconds",
}
QUANTILES = (50, 95, 99)

Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse_metrics(text: str) -> dict[Sample, float]:
    """Every sample of a Prometheus text exposition, keyed by (sample name, sorted labels)."""
    out: dict[Sample, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except ValueError as exc:
        raise InputError(f"/metrics is not a Prometheus text exposition: {exc}") from exc
    return out


def diff(before: Mapping[Sample, float], after: Mapping[Sample, float]) -> dict[Sample, float]:
    """``after - before`` per sample (a sample absent before counts from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _total(samples: Mapping[Sample, float], name: str, workload: str = "llm") -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and ("workload", workload) in labels)


def bucket_counts(samples: Mapping[Sample, float], metric: str, workload: str = "llm") -> list[tuple[float, float]]:
    """Cumulative (upper bound in s, count) of one histogram, summed over tiers, ascending; +Inf last."""
    name = f"{PREFIX}{metric}_bucket"
    by_le: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n != name or ("workload", workload) not in labels:
            continue
        le = float(dict(labels)["le"])
        by_le[le] = by_le.get(le, 0.0) + v
    return sorted(by_le.items())


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> dict | None:
    """The ``q``-quantile (0..1) of cumulative buckets in ms: ``value`` interpolated as PromQL does, and
    the bounds ``lo``..``hi`` of its bucket (``hi`` is None in the +Inf bucket). None without samples."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lo, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return {"value": lo * 1e3, "lo": lo * 1e3, "hi": None}
            value = lo + (le - lo) * (rank - below) / (count - below)
            return {"value": value * 1e3, "lo": lo * 1e3, "hi": le * 1e3}
        lo, below = le, count
    return None


def daemon_figures(delta: Mapping[Sample, float], workload: str = "llm") -> dict:
    """The daemon's view of one window from a ``/metrics`` difference: per latency metric the count,
    exact mean and bucket percentiles; requests, tokens and failures."""
    out: dict = {"source": "prometheus /metrics difference"}
    for key, metric in HISTOGRAMS.items():
        buckets = bucket_counts(delta, metric, workload)
        count = round(buckets[-1][1]) if buckets else 0
        total_s = _total(delta, f"{PREFIX}{metric}_sum", workload)
        stats: dict = {"count": count, "mean": total_s * 1e3 / count if count else None}
        for p in QUANTILES:
            est = bucket_quantile(buckets, p / 100)
            stats[f"p{p}"] = est["value"] if est else None
            stats[f"p{p}_bucket"] = [est["lo"], est["hi"]] if est else None
        stats["buckets_ms"] = [[le * 1e3 if not math.isinf(le) else None, round(c)] for le, c in buckets]
        out[key] = stats
    out["requests"] = round(_total(delta, f"{PREFIX}request_success_total", workload))
    out["tokens_out"] = round(_total(delta, f"{PREFIX}generation_tokens_total", workload))
    failures: dict[str, int] = {}
    for (n, labels), v in delta.items():
        lab = dict(labels)
        if n == f"{PREFIX}request_failure_total" and lab.get("workload") == workload and v:
            failures[lab.get("reason", "?")] = round(v)
    out["failures"] = failures
    return out


class LatencyWindows:
    """The daemon's MQTT ``tele/latency`` windows, collected while the bench runs (``--mqtt``)."""

    def __init__(self, host: str, port: int, topic: str, wait_s: float = 15.0) -> None:
        try:
            import paho.mqtt.client as paho
        except ImportError as exc:  # pragma: no cover - a core dependency
            raise InputError("--mqtt needs paho-mqtt") from exc
        self.topic, self.wait_s = topic, wait_s
        self.windows: list[dict] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.client.on_connect = lambda c, u, f, rc, p=None: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        try:
            self.client.connect(host, port)
        except OSError as exc:
            raise InputError(f"--mqtt {host}:{port}: cannot connect to the broker: {exc}") from exc
        self.client.loop_start()
        if not self._subscribed.wait(10):
            self.close()
            raise InputError(f"--mqtt {host}:{port}: no subscription to {topic} within 10 s")

    def _on_message(self, client, userdata, message) -> None:
        try:
            doc = json.loads(message.payload)
        except ValueError:
            return
        if isinstance(doc, dict) and not doc.get("historical"):
            with self._lock:
                self.windows.append(doc)

    def figures(self, start_wall: float, end_wall: float, workload: str = "llm") -> dict:
        """Percentiles from the merged histograms of the windows that overlap [start, end] (they also
        cover some time outside it); waits up to ``wait_s`` for the window that covers ``end``."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if any(w["window"]["end_wall"] >= end_wall for w in self.windows):
                    break
            time.sleep(0.1)
        with self._lock:
            chosen = [
                w for w in self.windows if w["window"]["end_wall"] > start_wall and w["window"]["start_wall"] < end_wall
            ]
        merged: dict[str, ExponentialHistogram] = {}
        requests = 0
        for w in chosen:
            for s in w.get("series", []):
                if s.get("workload") != workload:
                    continue
                requests += int(s.get("requests", 0))
                for metric, data in (s.get("histograms") or {}).items():
                    h = ExponentialHistogram.from_dict(data)
                    if metric in merged:
                        merged[metric].merge(h)
                    else:
                        merged[metric] = h
        out: dict = {
            "source": f"mqtt {self.topic}",
            "windows": len(chosen),
            "covered_wall_s": [
                min((w["window"]["start_wall"] for w in chosen), default=None),
                max((w["window"]["end_wall"] for w in chosen), default=None),
            ],
            "requests": requests,
        }
        for metric in HISTOGRAMS:
            got = merged.get(metric)
            stats: dict = {"count": got.count if got else 0}
            for p in QUANTILES:
                stats[f"p{p}"] = got.quantile(p / 100) if got else None
            out[metric] = stats
        return out

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
