"""bench serve's reading of the daemon's /metrics: a histogram difference and its bucket percentiles,
checked against numpy on the raw samples that went into a real prometheus_client histogram."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from edge_agent.bench import serve_daemon as sd
from edge_agent.metrics.prometheus import _LATENCY_BUCKETS


def _registry():
    r = CollectorRegistry()
    h = Histogram(
        "edge_agent:time_to_first_token_seconds", "t", ("workload", "tier"), buckets=_LATENCY_BUCKETS, registry=r
    )
    c = Counter("edge_agent:request_success", "n", ("workload", "tier"), registry=r)
    return r, h, c


def test_difference_holds_only_the_window_and_its_percentiles_bracket_numpys():
    rng = np.random.default_rng(7)
    r, h, c = _registry()
    for v in rng.uniform(0.5, 3.0, 40):  # before the window: slow requests that must not show
        h.labels("llm", "big").observe(float(v))
        c.labels("llm", "big").inc()
    before = sd.parse_metrics(generate_latest(r).decode())
    window = {"big": rng.lognormal(np.log(0.05), 0.6, 300), "small": rng.lognormal(np.log(0.12), 0.4, 200)}
    for tier, values in window.items():
        for v in values:
            h.labels("llm", tier).observe(float(v))
            c.labels("llm", tier).inc()
    h.labels("asr", "x").observe(9.0)  # another workload: ignored
    figures = sd.daemon_figures(sd.diff(before, sd.parse_metrics(generate_latest(r).decode())))
    samples_ms = np.concatenate(list(window.values())) * 1e3
    ttft = figures["ttft_ms"]
    assert figures["requests"] == ttft["count"] == len(samples_ms)
    assert abs(ttft["mean"] - samples_ms.mean()) < 1e-6 * samples_ms.mean()
    for p in (50, 95, 99):
        exact = float(np.percentile(samples_ms, p, method="inverted_cdf"))  # nearest rank
        lo, hi = ttft[f"p{p}_bucket"]
        assert lo <= exact <= hi, (p, exact, lo, hi)
        assert lo <= ttft[f"p{p}"] <= hi


def test_empty_window_has_no_percentiles_and_inf_bucket_has_no_upper_bound():
    r, h, _ = _registry()
    text = generate_latest(r).decode()
    assert sd.daemon_figures(sd.diff(sd.parse_metrics(text), sd.parse_metrics(text)))["ttft_ms"]["p50"] is None
    h.labels("llm", "t").observe(100.0)  # beyond the last finite bucket (60 s)
    est = sd.bucket_quantile(
        sd.bucket_counts(sd.parse_metrics(generate_latest(r).decode()), sd.HISTOGRAMS["ttft_ms"]), 0.5
    )
    assert est == {"value": 60_000.0, "lo": 60_000.0, "hi": None}
