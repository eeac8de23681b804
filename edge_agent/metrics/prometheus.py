"""Prometheus metrics for ``/metrics``, named after vLLM's (``vllm:time_to_first_token_seconds`` …)
with an ``edge_agent:`` prefix, so existing dashboards need only the prefix changed.

Histograms use fixed Prometheus buckets (seconds); the fleet-grade mergeable histograms with a
documented error are the MQTT telemetry's (OpenTelemetry exponential histograms), not these.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 - re-exported for the API
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..observe import Observation

log = logging.getLogger(__name__)

# Health snapshot key -> gauge name and help (``telemetry.health``); units in the names, as Prometheus asks.
_HEALTH = {
    "process_cpu_percent": ("process_cpu_percent", "Agent process CPU, percent of one core, since the last scrape"),
    "process_rss_bytes": ("process_resident_memory_bytes", "Agent process resident memory"),
    "memory_available_bytes": ("memory_available_bytes", "System memory available (MemAvailable)"),
    "memory_total_bytes": ("memory_total_bytes", "System memory (MemTotal)"),
    "load_1m": ("load1", "System load average over 1 minute"),
    "max_temp_c": ("max_temperature_celsius", "The hottest thermal sensor"),
    "cpu_freq_mhz_mean": ("cpu_frequency_mean_megahertz", "Mean current CPU frequency over cores"),
    "npu_freq_mhz": ("npu_frequency_megahertz", "NPU current frequency"),
    "npu_busy_percent": ("npu_busy_percent", "NPU busy share since the last scrape"),
}
_HEALTH_LABELLED = {
    "temperatures_c": ("temperature_celsius", "Thermal zone or hwmon sensor temperature", "sensor"),
    "throttle_counts": ("cpu_thermal_throttle_total", "Thermal throttle events since boot, over CPUs", "kind"),
    "rails_w": ("rail_power_watts", "Jetson INA3221 rail power", "rail"),
    "rapl_power_w": ("rapl_power_watts", "Intel RAPL domain power since the last scrape", "domain"),
}

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.387,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    60.0,
)
# A prefix cache's counters (``models.prefix_cache.PrefixStats`` fields): name, help, counter or gauge.
_PREFIX_CACHE = (
    ("lookups", "prefix_cache_lookups", "Prompts looked up in the prefix KV cache", True),
    ("lookup_tokens", "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix KV cache", True),
    ("hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache", True),
    ("evictions", "prefix_cache_evicted_blocks", "Prefix cache blocks evicted to stay within its bound", True),
    ("bytes", "prefix_cache_bytes", "Bytes of KV the prefix cache holds", False),
    ("max_bytes", "prefix_cache_max_bytes", "The prefix cache's bound in bytes", False),
)

_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class PrometheusMetrics:
    """The ``/metrics`` registry: latency histograms per workload and tier (``observe``, an
    ``observe.Observers`` consumer), failures, and the queue/batch gauges read at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._declare_request_metrics(r)
        self._declare_admission_metrics(r)
        self._declare_speech_metrics(r)
        self._load: list[tuple[str, Callable[[], tuple[int, int]]]] = []
        self._prefix: list[tuple[str, Callable[[], Any]]] = []
        r.register(_PrefixCacheCollector(self._prefix))
        self._health: Callable[[], dict[str, Any]] | None = None
        self._absent_seen: set[str] = set()
        self.health_gauges = {key: Gauge(f"edge_agent:{name}", doc, registry=r) for key, (name, doc) in _HEALTH.items()}
        self.health_labelled = {
            key: Gauge(f"edge_agent:{name}", doc, (label,), registry=r)
            for key, (name, doc, label) in _HEALTH_LABELLED.items()
        }
        self.health_absent = Gauge(
            "edge_agent:health_source_absent", "1 for each health source not present", ("source",), registry=r
        )

    def _declare_request_metrics(self, r: CollectorRegistry) -> None:
        """Per workload and tier: the request latency histograms and the token and request counters."""
        labels = ("workload", "tier")
        self.ttft = Histogram(
            "edge_agent:time_to_first_token_seconds",
            "Request admitted to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "edge_agent:inter_token_latency_seconds",
            "Gaps between streamed tokens",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "edge_agent:time_per_output_token_seconds",
            "(e2e - ttft) / (tokens - 1)",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "edge_agent:e2e_request_latency_seconds",
            "Request admitted to last token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "edge_agent:request_queue_time_seconds",
            "Admitted to scheduled",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("edge_agent:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("edge_agent:generation_tokens", "Tokens generated", labels, registry=r)
        self.requests = Counter("edge_agent:request_success", "Finished requests", labels, registry=r)

    def _declare_admission_metrics(self, r: CollectorRegistry) -> None:
        """Per workload: failures, refusals at admission, preemptions, and the running and waiting gauges."""
        self.failures = Counter(
            "edge_agent:request_failure", "Requests that failed or were rejected", ("workload", "reason"), registry=r
        )
        self.refused = Counter(
            "edge_agent:requests_refused",
            "Requests refused at admission, by reason and class (chat, interactive)",
            ("workload", "reason", "class"),
            registry=r,
        )
        self.preemptions = Counter(
            "edge_agent:preemptions", "Running requests that gave their row to a voice turn", ("workload",), registry=r
        )
        self.running = Gauge("edge_agent:num_requests_running", "Sequences in the batch", ("workload",), registry=r)
        self.waiting = Gauge("edge_agent:num_requests_waiting", "Requests queued", ("workload",), registry=r)

    def _declare_speech_metrics(self, r: CollectorRegistry) -> None:
        """The recogniser's latency histograms per tier, and the Wyoming requests by kind and outcome."""
        self.asr_first_partial = Histogram(
            "edge_agent:asr_first_partial_seconds",
            "First voiced audio to first partial",
            ("tier",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.asr_final = Histogram(
            "edge_agent:asr_final_seconds",
            "End of speech to final text",
            ("tier",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.wyoming = Counter(
            "edge_agent:wyoming_requests",
            "Wyoming protocol requests (describe, transcribe, handle, connection) by outcome",
            ("kind", "outcome"),
            registry=r,
        )

    def observe(self, obs: Observation) -> None:
        """One finished request or utterance, first-after-load included (every request is served); a warm-up
        is no client's request and is left out."""
        if obs.warmup:
            return
        if obs.workload == "asr":
            for metric, histogram in (("first_partial_ms", self.asr_first_partial), ("final_ms", self.asr_final)):
                for value in obs.samples.get(metric, ()):
                    histogram.labels(obs.tier).observe(value / 1e3)
            return
        lab = (obs.workload, obs.tier)
        for metric, histogram in (
            ("ttft_ms", self.ttft),
            ("itl_ms", self.itl),
            ("tpot_ms", self.tpot),
            ("queue_ms", self.queue),
            ("e2e_ms", self.e2e),
        ):
            for value in obs.samples.get(metric, ()):
                histogram.labels(*lab).observe(value / 1e3)
        self.prompt_tokens.labels(*lab).inc(obs.tokens_in)
        self.generation_tokens.labels(*lab).inc(obs.tokens_out)
        self.requests.labels(*lab).inc()

    def wyoming_request(self, kind: str, outcome: str) -> None:
        """One Wyoming request (``serving/doors/wyoming/server.py``); ``kind`` and ``outcome`` come from fixed sets."""
        self.wyoming.labels(kind, outcome).inc()

    def failed(self, workload: str, reason: str) -> None:
        self.failures.labels(workload, reason).inc()

    def track_load(self, workload: str, load: Callable[[], tuple[int, int]]) -> None:
        """``load()`` -> (waiting, running), read at every scrape."""
        self._load.append((workload, load))

    def track_prefix_cache(self, tier: str, stats: Callable[[], Any]) -> None:
        """``stats()`` -> a prefix cache's counters (``PrefixStats``, or None while it has none), read at every
        scrape into the ``edge_agent:prefix_cache_*`` series of ``tier``."""
        self._prefix.append((tier, stats))

    def track_health(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """``snapshot()`` -> a ``telemetry.health`` snapshot, read at every scrape into the health gauges."""
        self._health = snapshot

    def _read_health(self) -> None:
        if self._health is None:
            return
        try:
            doc = self._health()
        except Exception:  # a scrape must never fail because a sensor did
            log.warning("device health could not be read for /metrics", exc_info=True)
            return
        for key, gauge in self.health_gauges.items():
            if doc.get(key) is not None:
                gauge.set(doc[key])
        for key, gauge in self.health_labelled.items():
            for label, value in (doc.get(key) or {}).items():
                gauge.labels(label).set(value)
        absent = set(doc.get("absent", ()))
        for source in absent | self._absent_seen:  # a source that appeared since reads 0, not a stale 1
            self.health_absent.labels(source).set(1 if source in absent else 0)
        self._absent_seen |= absent

    def render(self) -> bytes:
        self._read_health()
        for workload, load in self._load:
            try:
                waiting, running = load()
            except Exception:  # a scrape must never fail because a loop is restarting
                continue
            self.waiting.labels(workload).set(waiting)
            self.running.labels(workload).set(running)
        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The tracked prefix caches' counters, read when ``/metrics`` is scraped (the cache counts, not us)."""

    def __init__(self, tracked: list[tuple[str, Callable[[], Any]]]) -> None:
        self.tracked = tracked

    def collect(self) -> Iterator[Metric]:
        families = {
            key: (CounterMetricFamily if counter else GaugeMetricFamily)(f"edge_agent:{name}", doc, labels=["tier"])
            for key, name, doc, counter in _PREFIX_CACHE
        }
        for tier, read in self.tracked:
            try:
                stats = read()
            except Exception:  # a scrape must never fail because a tier is being swapped
                continue
            if stats is None:
                continue
            for key, family in families.items():
                family.add_metric([tier], float(getattr(stats, key)))
        yield from families.values()
