from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_agent.metrics import LATENCY_METRICS, WARMUP, LatencyStats, RequestTiming, TimingRecorder

MS = 1e-3


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def timing(admitted, scheduled, tokens, finished, **kwargs) -> RequestTiming:
    """A timeline given in milliseconds, stored as monotonic seconds like the real clock."""
    return RequestTiming(
        admitted * MS,
        None if scheduled is None else scheduled * MS,
        tuple(t * MS for t in tokens),
        finished * MS,
        **kwargs,
    )


@pytest.mark.parametrize(
    "timeline, expected",
    [
        (
            (0, 5, [30, 40, 55], 55),
            dict(queue_ms=5, prefill_ms=25, ttft_ms=30, itl_ms=(10, 15), tpot_ms=12.5, e2e_ms=55, tokens_out=3),
        ),
        # finishing after the last token (detokenizer flush, stop check) counts in e2e and tpot
        (
            (0, 5, [30, 40, 55], 65),
            dict(queue_ms=5, prefill_ms=25, ttft_ms=30, itl_ms=(10, 15), tpot_ms=17.5, e2e_ms=65, tokens_out=3),
        ),
        (
            (100, 100, [120], 121),
            dict(queue_ms=0, prefill_ms=20, ttft_ms=20, itl_ms=(), tpot_ms=None, e2e_ms=21, tokens_out=1),
        ),
        (
            (0, 10, [], 12),  # failed in prefill: no first token
            dict(queue_ms=10, prefill_ms=None, ttft_ms=None, itl_ms=(), tpot_ms=None, e2e_ms=12, tokens_out=0),
        ),
        (
            (0, None, [], 300),  # shed from the queue
            dict(queue_ms=None, prefill_ms=None, ttft_ms=None, itl_ms=(), tpot_ms=None, e2e_ms=300, tokens_out=0),
        ),
        (
            (0, 2, [10, 10, 20, 20], 20),  # two tokens per step
            dict(queue_ms=2, prefill_ms=8, ttft_ms=10, itl_ms=(0, 10, 0), tpot_ms=10 / 3, e2e_ms=20, tokens_out=4),
        ),
    ],
)
def test_request_timing_math_on_fabricated_timelines(timeline, expected):
    record = timing(*timeline, tokens_in=7)
    for name, value in expected.items():
        got = getattr(record, name)
        if value is None:
            assert got is None, name
        else:
            assert got == pytest.approx(value, abs=1e-9), name
    if record.ttft_ms is not None and record.queue_ms is not None:
        assert record.ttft_ms == pytest.approx(record.queue_ms + record.prefill_ms)
    assert record.tokens_in == 7
    samples = record.samples()
    assert set(samples) == set(LATENCY_METRICS)
    assert samples["itl_ms"] == record.itl_ms and samples["e2e_ms"] == (record.e2e_ms,)


@pytest.mark.parametrize(
    "timeline, culprit",
    [
        ((10, 5, [30], 40), "scheduled"),
        ((0, 5, [30, 20], 40), "token 2"),
        ((0, 5, [30], 25), "finished"),
        ((0, 40, [30], 50), "token 1"),
    ],
)
def test_backwards_timeline_is_rejected_naming_the_step(timeline, culprit):
    with pytest.raises(ValueError, match=f"{culprit} at"):
        timing(*timeline)


def test_request_timing_is_frozen_and_slotted():
    record = timing(0, 5, [30], 40, tags={"x"})
    assert record.tags == frozenset({"x"}) and not hasattr(record, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.finished_s = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="tokens_in"):
        timing(0, 5, [30], 40, tokens_in=-1)


def test_recorder_builds_the_record_from_the_injected_clock():
    clock = Clock(0.0)
    rec = TimingRecorder(tokens_in=12, tags=[WARMUP], clock=clock)
    clock.now = 0.005
    rec.mark_scheduled()
    clock.now = 0.007
    rec.mark_scheduled()  # re-scheduled after preemption: queue time ends at the first
    for t in (0.030, 0.040, 0.055):
        clock.now = t
        rec.mark_token()
    rec.tag("first_after_load")
    record = rec.finish()
    assert record == RequestTiming(
        0.0, 0.005, (0.030, 0.040, 0.055), 0.055, 12, frozenset({WARMUP, "first_after_load"})
    )
    assert record.ttft_ms == pytest.approx(30) and record.tpot_ms == pytest.approx(12.5)
    clock.now = 1.0
    assert rec.finish() is record  # idempotent: the serving loop may finish on error paths twice
    for late in (rec.mark_token, rec.mark_scheduled, lambda: rec.tag("x")):
        with pytest.raises(RuntimeError, match="already finished"):
            late()


def test_recorder_counts_several_tokens_per_step():
    clock = Clock(1.0)
    rec = TimingRecorder(clock=clock)
    rec.mark_scheduled()
    clock.now = 1.01
    rec.mark_token(3)
    assert rec.finish().token_times_s == (1.01, 1.01, 1.01)


def fabricated_requests(n: int, seed: int) -> list[RequestTiming]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        admitted = k * 0.1
        scheduled = admitted + rng.exponential(0.01)
        first = scheduled + rng.lognormal(np.log(0.03), 0.3)
        tokens = first + np.concatenate([[0.0], np.cumsum(rng.lognormal(np.log(0.01), 0.2, rng.integers(0, 20)))])
        out.append(RequestTiming(admitted, scheduled, tuple(tokens), float(tokens[-1]), 16))
    return out


def test_latency_stats_summary_matches_numpy_and_excludes_warmup():
    clock = Clock(100.0)
    stats = LatencyStats(window_s=60.0, clock=clock)
    requests = fabricated_requests(300, seed=1)
    stats.add(timing(0, 0, [5000], 9000, tags={WARMUP}))  # a 5 s compile must not count
    for record in requests:
        assert stats.add(record)
    assert (stats.requests, stats.excluded) == (300, 1)

    summary = stats.summary()
    assert list(summary) == list(LATENCY_METRICS)
    hists = stats.histograms()
    for metric in LATENCY_METRICS:
        values = [v for r in requests for v in r.samples()[metric]]
        row = summary[metric]
        assert set(row) == {"p50", "p95", "p99", "mean", "count"}
        assert row["count"] == len(values) == hists[metric].count
        for key, p in (("p50", 50), ("p95", 95), ("p99", 99)):
            assert row[key] == float(np.percentile(values, p, method="inverted_cdf")), (metric, key)
        assert row["mean"] == pytest.approx(np.mean(values), rel=1e-12)
        p99 = hists[metric].quantile(0.99)
        assert abs(p99 - row["p99"]) / row["p99"] <= hists[metric].relative_error
    assert max(hists["ttft_ms"].max, summary["ttft_ms"]["p99"]) < 5000

    clock.now = 161.0  # the window has moved on; the cumulative histograms have not
    assert stats.summary()["ttft_ms"] == {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}
    assert stats.histograms()["ttft_ms"].count == 300


def test_latency_stats_histograms_copy_or_reset():
    stats = LatencyStats(clock=Clock())
    stats.add(timing(0, 1, [10, 20], 20))
    copy = stats.histograms()
    copy["e2e_ms"].record(1.0)
    assert stats.histograms()["e2e_ms"].count == 1  # callers get copies
    taken = stats.histograms(reset=True)  # delta temporality: each telemetry window its own
    assert taken["itl_ms"].count == 1 and stats.histograms()["itl_ms"].count == 0
    assert stats.summary()["e2e_ms"]["count"] == 1  # the SLA window is not reset with them
