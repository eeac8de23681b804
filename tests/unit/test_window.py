from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest

from edge_agent.metrics import FIRST_AFTER_LOAD, WARMUP, MetricSnapshot, RollingWindow, WindowSnapshot, nearest_rank


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("n", [1, 2, 3, 7, 19, 20, 21, 100, 101, 997, 1001])
@pytest.mark.parametrize("p", [0, 1, 25, 50, 90, 95, 99, 99.9, 100])
def test_nearest_rank_matches_numpy_inverted_cdf(n, p):
    values = sorted(np.random.default_rng(n).lognormal(4.0, 0.8, n).tolist())
    assert nearest_rank(values, p) == float(np.percentile(values, p, method="inverted_cdf"))


def test_nearest_rank_is_exact_where_float_percent_rounds_up():
    # 99.9 % of 1000 samples is exactly 999 of them; numpy computes 0.999...01 * 1000 and takes the 1000th.
    values = [float(v) for v in range(1, 1001)]
    assert nearest_rank(values, 99.9) == 999.0
    assert sum(v <= 999.0 for v in values) / len(values) >= 0.999
    assert nearest_rank([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        nearest_rank(values, 101)


def test_samples_expire_by_time_with_lower_exclusive_horizon():
    clock = Clock()
    window = RollingWindow(window_s=30.0, max_samples=100, clock=clock)
    for t in range(0, 40, 10):  # samples at t = 0, 10, 20, 30
        clock.now = float(t)
        window.record("ttft_ms", float(t))
    assert window.values("ttft_ms", now=35.0) == [10.0, 20.0, 30.0]
    clock.now = 40.0
    window.record("ttft_ms", 40.0)
    assert window.values("ttft_ms") == [20.0, 30.0, 40.0]  # 10 is exactly 30 s old: gone
    assert window.count("ttft_ms", now=100.0) == 0
    assert window.snapshot(now=100.0)["ttft_ms"] == MetricSnapshot(0)


def test_snapshot_at_an_earlier_time_does_not_see_later_samples():
    clock = Clock(10.0)
    window = RollingWindow(60.0, clock=clock)
    window.record("e2e_ms", 1.0)
    clock.now = 20.0
    window.record("e2e_ms", 2.0)
    assert window.values("e2e_ms", now=15.0) == [1.0]


def test_samples_expire_by_count_newest_kept_per_metric():
    clock = Clock()
    window = RollingWindow(window_s=1000.0, max_samples=3, clock=clock)
    for v in range(5):
        window.record("itl_ms", float(v))
    window.record("ttft_ms", 9.0)
    assert window.values("itl_ms") == [2.0, 3.0, 4.0]
    assert window.count("ttft_ms") == 1


@pytest.mark.parametrize(
    "tags, exclude, kept",
    [
        ((WARMUP,), None, False),
        ((FIRST_AFTER_LOAD, "x"), None, False),
        (("x",), None, True),
        ((), None, True),
        ((WARMUP,), (), True),  # a diagnostic window may keep everything
        (("canary",), ("canary",), False),
    ],
)
def test_tagged_samples_are_excluded(tags, exclude, kept):
    kwargs = {} if exclude is None else {"exclude_tags": exclude}
    window = RollingWindow(60.0, clock=Clock(), **kwargs)
    assert window.record("ttft_ms", 500.0, tags=tags) is kept
    assert window.count("ttft_ms") == int(kept)
    assert window.excluded == int(not kept)


def test_snapshot_statistics_match_numpy():
    values = np.random.default_rng(3).lognormal(5.0, 0.5, 777).tolist()
    clock = Clock(5.0)
    window = RollingWindow(60.0, clock=clock)
    assert window.record_many("ttft_ms", values) == len(values)
    window.record("e2e_ms", 42.0)
    snap = window.snapshot()
    assert isinstance(snap, WindowSnapshot) and snap.at == 5.0 and snap.window_s == 60.0
    stats = snap["ttft_ms"]
    for name, p in (("p50", 50), ("p95", 95), ("p99", 99)):
        assert getattr(stats, name) == float(np.percentile(values, p, method="inverted_cdf"))
    assert stats.count == 777 and stats.mean == pytest.approx(np.mean(values), rel=1e-12)
    assert (stats.min, stats.max) == (min(values), max(values))
    assert window.percentile("ttft_ms", 95) == stats.p95 and window.mean("ttft_ms") == stats.mean
    assert snap["e2e_ms"] == MetricSnapshot(1, 42.0, 42.0, 42.0, 42.0, 42.0, 42.0)
    assert snap["tpot_ms"].count == 0 and snap["tpot_ms"].p99 is None
    assert set(stats.as_dict()) == {"count", "p50", "p95", "p99", "mean", "min", "max"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.at = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.metrics["x"] = stats  # type: ignore[index]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_samples_are_rejected(bad):
    window = RollingWindow(60.0, clock=Clock())
    with pytest.raises(ValueError, match="ttft_ms"):
        window.record("ttft_ms", bad)
    assert window.count("ttft_ms") == 0


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"window_s": math.inf}, {"max_samples": 0}, {"max_samples": 2.5}])
def test_constructor_validation(kwargs):
    with pytest.raises(ValueError):
        RollingWindow(**kwargs)


def test_concurrent_record_and_snapshot_stay_consistent():
    window = RollingWindow(window_s=1e9, max_samples=50_000, clock=Clock())
    errors: list[BaseException] = []

    def device() -> None:
        for k in range(20_000):
            window.record("itl_ms", float(k % 100))

    def telemetry() -> None:
        try:
            for _ in range(200):
                stats = window.snapshot()["itl_ms"]
                assert stats.count == 0 or 0.0 <= stats.p50 <= stats.p99 <= 99.0
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=device, daemon=True), threading.Thread(target=telemetry, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert window.count("itl_ms") == 20_000
