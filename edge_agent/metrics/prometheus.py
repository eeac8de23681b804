"""Prometheus metrics for ``/metrics``, named after vLLM's (``vllm:time_to_first_token_seconds`` …)
with an ``edge_agent:`` prefix, so existing dashboards need only the prefix changed.

Histograms use fixed Prometheus buckets (seconds); the fleet-grade mergeable histograms with a
documented error are the MQTT telemetry's (OpenTelemetry exponential histograms), not these.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 - re-exported for the API
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from ..observe import Observation

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.387, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class PrometheusMetrics:
    """The ``/metrics`` registry: latency histograms per workload and tier (``observe``, an
    ``observe.Observers`` consumer), failures, and the queue/batch gauges read at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("workload", "tier")
        self.ttft = Histogram("edge_agent:time_to_first_token_seconds", "Request admitted to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("edge_agent:inter_token_latency_seconds", "Gaps between streamed tokens",
                             labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("edge_agent:time_per_output_token_seconds", "(e2e - ttft) / (tokens - 1)",
                              labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("edge_agent:e2e_request_latency_seconds", "Request admitted to last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("edge_agent:request_queue_time_seconds", "Admitted to scheduled",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("edge_agent:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("edge_agent:generation_tokens", "Tokens generated", labels, registry=r)
        self.requests = Counter("edge_agent:request_success", "Finished requests", labels, registry=r)
        self.failures = Counter("edge_agent:request_failure", "Requests that failed or were rejected",
                                ("workload", "reason"), registry=r)
        self.running = Gauge("edge_agent:num_requests_running", "Sequences in the batch", ("workload",), registry=r)
        self.waiting = Gauge("edge_agent:num_requests_waiting", "Requests queued", ("workload",), registry=r)
        self.asr_first_partial = Histogram("edge_agent:asr_first_partial_seconds", "First voiced audio to first "
                                           "partial", ("tier",), buckets=_LATENCY_BUCKETS, registry=r)
        self.asr_final = Histogram("edge_agent:asr_final_seconds", "End of speech to final text", ("tier",),
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self._load: list[tuple[str, Callable[[], tuple[int, int]]]] = []

    def observe(self, obs: Observation) -> None:
        """One finished request or utterance, first-after-load included (every request is served)."""
        if obs.workload == "asr":
            for metric, histogram in (("first_partial_ms", self.asr_first_partial), ("final_ms", self.asr_final)):
                for value in obs.samples.get(metric, ()):
                    histogram.labels(obs.tier).observe(value / 1e3)
            return
        lab = (obs.workload, obs.tier)
        for metric, histogram in (("ttft_ms", self.ttft), ("itl_ms", self.itl), ("tpot_ms", self.tpot),
                                  ("queue_ms", self.queue), ("e2e_ms", self.e2e)):
            for value in obs.samples.get(metric, ()):
                histogram.labels(*lab).observe(value / 1e3)
        self.prompt_tokens.labels(*lab).inc(obs.tokens_in)
        self.generation_tokens.labels(*lab).inc(obs.tokens_out)
        self.requests.labels(*lab).inc()

    def failed(self, workload: str, reason: str) -> None:
        self.failures.labels(workload, reason).inc()

    def track_load(self, workload: str, load: Callable[[], tuple[int, int]]) -> None:
        """``load()`` -> (waiting, running), read at every scrape."""
        self._load.append((workload, load))

    def render(self) -> bytes:
        for workload, load in self._load:
            try:
                waiting, running = load()
            except Exception:  # a scrape must never fail because a loop is restarting
                continue
            self.waiting.labels(workload).set(waiting)
            self.running.labels(workload).set(running)
        return generate_latest(self.registry)
