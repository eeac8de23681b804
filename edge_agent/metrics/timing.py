"""Per-request latency: the timeline of one request and the aggregate over many.

Vocabulary (docs/metrics.md, compatible with GenAI-Perf / vLLM bench):

    admitted ──queue_ms──▶ scheduled ──prefill_ms──▶ token 1 ─itl─▶ token 2 ─itl─▶ … token n ─▶ finished
    └──────────────────── ttft_ms ──────────────────┘
    └──────────────────────────────────── e2e_ms ───────────────────────────────────────────────┘
    tpot_ms = (e2e_ms - ttft_ms) / (n - 1)

Timestamps are monotonic seconds (``time.monotonic`` or an injected clock); every derived figure is
in milliseconds. ``TimingRecorder`` is what the serving loop touches per token; it freezes into a
``RequestTiming`` when the request ends, and ``LatencyStats`` turns those into SLA windows and
mergeable histograms.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from .histogram import DEFAULT_MAX_SIZE, ExponentialHistogram
from .window import SLA_EXCLUDED_TAGS, RollingWindow, WindowSnapshot

LATENCY_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms")


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """The timeline of one finished request (monotonic seconds)."""

    admitted_s: float
    scheduled_s: float | None  # None: never reached the engine (rejected, cancelled in queue)
    token_times_s: tuple[float, ...]  # emission time of each content token
    finished_s: float
    tokens_in: int = 0
    tags: frozenset[str] = field(default_factory=frozenset)
    cached_tokens: int = 0  # of tokens_in, those whose KV came from the prefix cache (not prefilled)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times_s", tuple(self.token_times_s))
        object.__setattr__(self, "tags", frozenset(self.tags))
        if self.tokens_in < 0:
            raise ValueError(f"tokens_in must be >= 0, got {self.tokens_in}")
        if not 0 <= self.cached_tokens <= max(self.tokens_in, 0):
            raise ValueError(f"cached_tokens must lie within 0..tokens_in ({self.tokens_in}), got {self.cached_tokens}")
        # A monotonic clock never runs backwards: an out-of-order timeline is a bookkeeping bug
        # and would otherwise surface as negative latencies far from its cause.
        points = [("admitted", self.admitted_s)]
        if self.scheduled_s is not None:
            points.append(("scheduled", self.scheduled_s))
        points += [(f"token {k + 1}", t) for k, t in enumerate(self.token_times_s)]
        points.append(("finished", self.finished_s))
        for (name_a, a), (name_b, b) in pairwise(points):
            if b < a:
                raise ValueError(f"request timeline goes backwards: {name_b} at {b!r} s is before {name_a} at {a!r} s")

    @property
    def tokens_out(self) -> int:
        return len(self.token_times_s)

    @property
    def queue_ms(self) -> float | None:
        return None if self.scheduled_s is None else (self.scheduled_s - self.admitted_s) * 1e3

    @property
    def prefill_ms(self) -> float | None:
        if self.scheduled_s is None or not self.token_times_s:
            return None
        return (self.token_times_s[0] - self.scheduled_s) * 1e3

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times_s[0] - self.admitted_s) * 1e3 if self.token_times_s else None

    @property
    def itl_ms(self) -> tuple[float, ...]:
        times = self.token_times_s
        return tuple((b - a) * 1e3 for a, b in pairwise(times))

    @property
    def e2e_ms(self) -> float:
        return (self.finished_s - self.admitted_s) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        n = len(self.token_times_s)
        if n < 2:
            return None  # one token has no "per output token" time beyond its TTFT
        return (self.e2e_ms - (self.token_times_s[0] - self.admitted_s) * 1e3) / (n - 1)

    def samples(self) -> dict[str, tuple[float, ...]]:
        """Every metric of ``LATENCY_METRICS`` as its samples (none, one, or one per gap for ITL)."""
        single = {
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
            "queue_ms": self.queue_ms,
            "prefill_ms": self.prefill_ms,
        }
        out: dict[str, tuple[float, ...]] = {name: () if value is None else (value,) for name, value in single.items()}
        out["itl_ms"] = self.itl_ms
        return out


class TimingRecorder:
    """Mutable timeline of one in-flight request; owned by the thread serving it."""

    __slots__ = ("_admitted", "_cached", "_clock", "_result", "_scheduled", "_tags", "_tokens", "_tokens_in")

    def __init__(
        self,
        tokens_in: int = 0,
        tags: Iterable[str] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        admitted_s: float | None = None,
    ) -> None:
        self._clock = clock
        self._admitted = clock() if admitted_s is None else admitted_s
        self._scheduled: float | None = None
        self._tokens: list[float] = []
        self._tokens_in = tokens_in
        self._tags = set(tags)
        self._cached = 0
        self._result: RequestTiming | None = None

    def _check_open(self) -> None:
        if self._result is not None:
            raise RuntimeError("request timing already finished: record nothing after finish()")

    def tag(self, tag: str) -> None:
        self._check_open()
        self._tags.add(tag)

    def mark_scheduled(self) -> None:
        """Prefill starts. Only the first call counts: a preempted request was queued once."""
        self._check_open()
        if self._scheduled is None:
            self._scheduled = self._clock()

    def mark_cached(self, tokens: int) -> None:
        """``tokens`` of the prompt were found in the prefix cache (their prefill was skipped)."""
        self._check_open()
        self._cached = tokens

    def mark_token(self, n: int = 1, at: float | None = None) -> None:
        """``n`` content tokens emitted now, or ``at`` (a reading of the same clock), n > 1 when several are
        detokenized in one step."""
        self._check_open()
        now = self._clock() if at is None else at
        self._tokens.extend([now] * n)

    def finish(self) -> RequestTiming:
        """Freeze the timeline; calling again returns the same record."""
        if self._result is None:
            self._result = RequestTiming(
                self._admitted,
                self._scheduled,
                tuple(self._tokens),
                self._clock(),
                self._tokens_in,
                frozenset(self._tags),
                self._cached,
            )
        return self._result


class LatencyStats:
    """Aggregates finished requests into a rolling SLA window and cumulative histograms.

    Requests tagged with any of ``exclude_tags`` are counted in ``excluded`` and feed neither: a
    warm-up's compile time is neither the local SLA's business nor the fleet's.
    Thread-safe: the serving thread ``add``s while the telemetry thread reads.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        max_samples: int = 10_000,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_buckets: int = DEFAULT_MAX_SIZE,
        exclude_tags: Collection[str] = SLA_EXCLUDED_TAGS,
    ) -> None:
        self.window = RollingWindow(window_s, max_samples, clock=clock, exclude_tags=exclude_tags)
        self._exclude_tags = frozenset(exclude_tags)
        self._max_buckets = max_buckets
        self._lock = threading.Lock()
        self._histograms = self._fresh_histograms()
        self.requests = 0
        self.excluded = 0

    def _fresh_histograms(self) -> dict[str, ExponentialHistogram]:
        return {name: ExponentialHistogram(self._max_buckets) for name in LATENCY_METRICS}

    def add(self, timing: RequestTiming) -> bool:
        """Account one finished request; False when its tags exclude it."""
        with self._lock:
            if not self._exclude_tags.isdisjoint(timing.tags):
                self.excluded += 1
                return False
            self.requests += 1
            for name, values in timing.samples().items():
                if values:
                    self._histograms[name].record_many(values)
                    self.window.record_many(name, values)
        return True

    def snapshot(self, now: float | None = None) -> WindowSnapshot:
        return self.window.snapshot(now)

    def summary(self, now: float | None = None) -> dict[str, dict[str, float | int | None]]:
        """``{metric: {p50, p95, p99, mean, count}}`` over the window, every metric present."""
        snap = self.window.snapshot(now)
        return {
            name: {
                "p50": snap[name].p50,
                "p95": snap[name].p95,
                "p99": snap[name].p99,
                "mean": snap[name].mean,
                "count": snap[name].count,
            }
            for name in LATENCY_METRICS
        }

    def histograms(self, *, reset: bool = False) -> dict[str, ExponentialHistogram]:
        """Copies of the cumulative histograms; ``reset`` starts new ones (OTLP delta temporality)."""
        with self._lock:
            if reset:
                taken, self._histograms = self._histograms, self._fresh_histograms()
                return taken
            return {name: hist.copy() for name, hist in self._histograms.items()}
