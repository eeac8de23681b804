"""What the inference threads touch: a bounded in-memory accumulator of one telemetry window.

``observe`` / ``observe_timing`` cost one lock and a few histogram bucket increments: no I/O, no
allocation that grows with time. ``take`` (telemetry thread) swaps the whole window out, so the
hot path never waits on JSON, SQLite or the network.

Per (workload, tier) series: request/error/token counts, an OTel exponential histogram per metric
(mergeable across devices) and up to ``max_local_samples`` raw samples per metric for the exact
local percentiles (a seeded reservoir beyond that: the local figures are then estimates, which is
fine since they are marked not-for-aggregation and the histograms carry the truth).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..metrics.histogram import DEFAULT_MAX_SIZE, ExponentialHistogram
from ..metrics.timing import RequestTiming
from ..metrics.window import SLA_EXCLUDED_TAGS, nearest_rank
from .schema import WINDOW_METRICS, Histogram, LocalQuantiles, Series, Throughput


@dataclass
class SeriesData:
    """One (workload, tier) series of a window: counts, a histogram and bounded raw samples per metric."""

    workload: str
    tier: str
    model: str
    engine_hash: str | None = None
    requests: int = 0
    errors: int = 0
    tokens_out: int = 0
    histograms: dict[str, ExponentialHistogram] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)

    def to_series(self, duration_s: float) -> Series:
        hists = {m: Histogram.of(h) for m, h in self.histograms.items() if h.count}
        local = {}
        for m, values in self.samples.items():
            ordered = sorted(values)
            local[m] = LocalQuantiles(
                count=self.seen.get(m, len(ordered)),
                p50=nearest_rank(ordered, 50),
                p95=nearest_rank(ordered, 95),
                p99=nearest_rank(ordered, 99),
            )
        per_s = 1.0 / duration_s if duration_s > 0 else 0.0
        return Series(
            workload=self.workload,
            tier=self.tier,
            model=self.model,
            engine_hash=self.engine_hash,
            requests=self.requests,
            errors=self.errors,
            tokens_out=self.tokens_out,
            throughput=Throughput(requests_per_s=self.requests * per_s, tokens_per_s=self.tokens_out * per_s),
            histograms=hists,
            relative_error={m: h.relative_error for m, h in self.histograms.items() if h.count},
            local=local,
        )


class WindowAccumulator:
    """Thread-safe; bounded by ``max_series`` × metrics × (``max_buckets`` + ``max_local_samples``)."""

    def __init__(
        self, max_series: int = 32, max_local_samples: int = 2048, max_buckets: int = DEFAULT_MAX_SIZE, seed: int = 0
    ) -> None:
        self.max_series, self.max_local_samples, self.max_buckets = max_series, max_local_samples, max_buckets
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], SeriesData] = {}
        self._rng = random.Random(seed)
        self.overflow = 0  # observations dropped because max_series distinct series were already open
        self.rejected_samples = 0  # NaN / negative / unknown-metric samples ignored

    def observe(
        self,
        workload: str,
        tier: str,
        model: str,
        samples: Mapping[str, Iterable[float]] = {},
        *,
        tokens_out: int = 0,
        error: bool = False,
        engine_hash: str | None = None,
        requests: int = 1,
    ) -> None:
        with self._lock:
            key = (workload, tier)
            s = self._series.get(key)
            if s is None:
                if len(self._series) >= self.max_series:
                    self.overflow += 1
                    return
                s = self._series[key] = SeriesData(workload, tier, model, engine_hash)
            s.model, s.engine_hash = model, engine_hash or s.engine_hash
            s.requests += requests
            s.errors += int(error)
            s.tokens_out += tokens_out
            for metric, values in samples.items():
                if metric not in WINDOW_METRICS:
                    self.rejected_samples += 1
                    continue
                hist = s.histograms.get(metric)
                if hist is None:
                    hist = s.histograms[metric] = ExponentialHistogram(self.max_buckets)
                    s.samples[metric] = []
                kept = s.samples[metric]
                for v in values:
                    try:
                        hist.record(v)
                    except ValueError:
                        self.rejected_samples += 1
                        continue
                    n = s.seen.get(metric, 0) + 1
                    s.seen[metric] = n
                    if len(kept) < self.max_local_samples:
                        kept.append(float(v))
                    else:  # reservoir: every sample equally likely to be kept
                        j = self._rng.randrange(n)
                        if j < self.max_local_samples:
                            kept[j] = float(v)

    def observe_timing(
        self,
        workload: str,
        tier: str,
        model: str,
        timing: RequestTiming,
        *,
        error: bool = False,
        engine_hash: str | None = None,
    ) -> bool:
        """One finished request; warm-up / first-after-load requests are left out (False)."""
        if not SLA_EXCLUDED_TAGS.isdisjoint(timing.tags):
            return False
        samples = {m: v for m, v in timing.samples().items() if v}
        self.observe(workload, tier, model, samples, tokens_out=timing.tokens_out, error=error, engine_hash=engine_hash)
        return True

    def take(self) -> list[SeriesData]:
        with self._lock:
            taken, self._series = self._series, {}
        return [taken[k] for k in sorted(taken)]
