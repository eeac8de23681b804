"""Rolling windows of latency samples with exact nearest-rank percentiles.

A window keeps, per metric, the samples of the last ``window_s`` seconds and at most ``max_samples``
of them (the newest win). Percentiles are nearest-rank: the smallest sample with at least p % of the
samples <= it, i.e. ``sorted[ceil(p/100 * n) - 1]``, the same as ``numpy.percentile(...,
method="inverted_cdf")``. They are always reported with ``count``: an SLA decision on 3 samples is
noise (the SLA policy waits for ``min_samples``, 20 by default), and the caller decides.

Samples tagged with any of ``exclude_tags`` (warm-up, first request after a model load) are dropped
at ``record``: they measure compilation and cache warming, not the service a user gets.

Threading: one lock guards the deques; the device thread records while the telemetry thread
snapshots. Sorting happens outside the lock so a snapshot never stalls the device thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal
from types import MappingProxyType

WARMUP = "warmup"
FIRST_AFTER_LOAD = "first_after_load"
SLA_EXCLUDED_TAGS = frozenset({WARMUP, FIRST_AFTER_LOAD})


def nearest_rank(sorted_values: Sequence[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile (``0 <= p <= 100``) of ascending values; None if empty."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p!r}")
    n = len(sorted_values)
    if n == 0:
        return None
    # Decimal(repr(p)) takes 99.9 as exactly 999/10: float p * n would put ceil() one rank off
    # whenever p * n / 100 should be an integer but rounds just above it.
    rank = max(1, math.ceil(Decimal(repr(float(p))) * n / 100))
    return sorted_values[rank - 1]


def percentile(values: Iterable[float], p: float) -> float | None:
    """``nearest_rank`` of ``values`` in any order (sorted here); None if empty."""
    return nearest_rank(sorted(values), p)


@dataclass(frozen=True, slots=True)
class MetricSnapshot:
    """One metric over one window. Every statistic is None when ``count`` is 0."""

    count: int
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> MetricSnapshot:
        ordered = sorted(values)
        if not ordered:
            return cls(0)
        return cls(
            len(ordered),
            nearest_rank(ordered, 50),
            nearest_rank(ordered, 95),
            nearest_rank(ordered, 99),
            math.fsum(ordered) / len(ordered),
            ordered[0],
            ordered[-1],
        )

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


EMPTY = MetricSnapshot(0)


@dataclass(frozen=True, slots=True)
class WindowSnapshot:
    """Every metric of a window at clock time ``at``, covering ``(at - window_s, at]``."""

    at: float
    window_s: float
    metrics: Mapping[str, MetricSnapshot]

    def __getitem__(self, metric: str) -> MetricSnapshot:
        # A metric nobody recorded yet is an empty window, not an error: the SLA check sees count 0.
        return self.metrics.get(metric, EMPTY)


class RollingWindow:
    """Per-metric samples over the last ``window_s`` seconds, at most ``max_samples`` each."""

    def __init__(
        self,
        window_s: float = 60.0,
        max_samples: int = 10_000,
        *,
        clock: Callable[[], float] = time.monotonic,
        exclude_tags: Collection[str] = SLA_EXCLUDED_TAGS,
    ) -> None:
        if not window_s > 0 or math.isinf(window_s):
            raise ValueError(f"window_s must be a finite number > 0, got {window_s!r}")
        if not isinstance(max_samples, int) or max_samples < 1:
            raise ValueError(f"max_samples must be an integer >= 1, got {max_samples!r}")
        self.window_s = float(window_s)
        self.max_samples = max_samples
        self.exclude_tags = frozenset(exclude_tags)
        self.excluded = 0  # samples dropped for their tags, since creation
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def record(self, metric: str, value: float, tags: Collection[str] = ()) -> bool:
        """Add one sample at ``clock()``; False when its tags exclude it."""
        return self.record_many(metric, (value,), tags) == 1

    def record_many(self, metric: str, values: Iterable[float], tags: Collection[str] = ()) -> int:
        """Add samples (e.g. one request's inter-token gaps) at ``clock()``; returns how many were kept."""
        values = list(values)
        for value in values:
            # NaN would make sorting (and every percentile after it) meaningless.
            if not math.isfinite(value):
                raise ValueError(f"{metric}: sample must be a finite number, got {value!r}")
        now = self._clock()
        with self._lock:
            if tags and not self.exclude_tags.isdisjoint(tags):
                self.excluded += len(values)
                return 0
            samples = self._samples.get(metric)
            if samples is None:
                samples = self._samples[metric] = deque(maxlen=self.max_samples)
            samples.extend((now, float(v)) for v in values)
            self._expire(samples, now)
        return len(values)

    def _expire(self, samples: deque[tuple[float, float]], now: float) -> None:
        horizon = now - self.window_s
        while samples and samples[0][0] <= horizon:
            samples.popleft()

    def values(self, metric: str, now: float | None = None) -> list[float]:
        """Samples of ``metric`` in ``(now - window_s, now]``, oldest first."""
        now = self._clock() if now is None else now
        with self._lock:
            return self._values_locked(metric, now)

    def _values_locked(self, metric: str, now: float) -> list[float]:
        samples = self._samples.get(metric)
        if not samples:
            return []
        self._expire(samples, now)
        # A ``now`` older than the newest sample (a replayed snapshot) must not see the future.
        return [v for t, v in samples if t <= now]

    def count(self, metric: str, now: float | None = None) -> int:
        return len(self.values(metric, now))

    def percentile(self, metric: str, p: float, now: float | None = None) -> float | None:
        return nearest_rank(sorted(self.values(metric, now)), p)

    def mean(self, metric: str, now: float | None = None) -> float | None:
        values = self.values(metric, now)
        return math.fsum(values) / len(values) if values else None

    def metrics(self) -> list[str]:
        with self._lock:
            return sorted(self._samples)

    def snapshot(self, now: float | None = None) -> WindowSnapshot:
        now = self._clock() if now is None else now
        with self._lock:  # one lock for all metrics: a snapshot never mixes two moments
            per_metric = {name: self._values_locked(name, now) for name in sorted(self._samples)}
        stats = {name: MetricSnapshot.of(values) for name, values in per_metric.items()}
        return WindowSnapshot(now, self.window_s, MappingProxyType(stats))
