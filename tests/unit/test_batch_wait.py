"""AdaptiveWait: the arrival-gap estimate, the AIMD slack and the wait decision, table-tested with a
fake clock against values worked out by hand from the rule's definition."""

from __future__ import annotations

import pytest

from edge_agent.serving.batch_wait import AdaptiveWait, WaitState


def primed(allowed_s: float, arrivals=(0.0, 0.02, 0.04), max_wait_s: float = 0.08) -> AdaptiveWait:
    """A rule that has seen ``arrivals`` and been allowed ``allowed_s`` of wait."""
    w = AdaptiveWait(max_wait_s, initial_wait_s=allowed_s)
    for t in arrivals:
        w.observe_arrival(t)
    return w


def test_a_fresh_rule_never_waits():
    # no rate estimate and no slack learnt yet: an idle device starts the batch at once
    w = AdaptiveWait(0.08)
    assert w.wait_s(0.0, 0.0, 3) == 0.0
    w.observe_arrival(0.0)
    assert w.wait_s(0.0, 0.0, 3) == 0.0  # one arrival: no gap known yet
    w.observe_arrival(0.01)
    assert w.wait_s(0.01, 0.01, 3) == 0.0  # a gap, but no slack allowed yet (initial 0)


def test_gap_estimate_is_an_ewma_with_outliers_capped():
    w = AdaptiveWait(0.1, gap_alpha=0.5, gap_cap_factor=10.0)
    w.observe_arrival(1.0)
    assert w.mean_gap_s is None
    w.observe_arrival(1.2)
    assert w.mean_gap_s == pytest.approx(0.2)  # the first gap is taken as is
    w.observe_arrival(1.3)
    assert w.mean_gap_s == pytest.approx(0.2 + 0.5 * (0.1 - 0.2))
    w.observe_arrival(101.3)  # a 100 s pause counts as the cap, 10 × 0.1 s
    assert w.mean_gap_s == pytest.approx(0.15 + 0.5 * (1.0 - 0.15))
    w.observe_arrival(101.0)  # out of order (another thread's clock read): gap 0, last arrival kept
    assert w.last_arrival == 101.3 and w.mean_gap_s == pytest.approx(0.575 / 2)


@pytest.mark.parametrize(
    "outcomes, allowed_ms",
    [
        ([], 0.0),
        ([True], 5.0),  # additive: max_wait / 16 = 5 ms per met SLA
        ([True] * 4, 20.0),
        ([True] * 40, 80.0),  # never above the configured timeout
        ([True] * 8 + [False], 20.0),  # multiplicative: 40 ms cut in half on a breach
        ([True] * 8 + [False, False], 10.0),
        ([True] * 8 + [False, True], 25.0),
        ([False] * 3, 0.0),  # nothing to cut below zero
    ],
)
def test_aimd_slack(outcomes, allowed_ms):
    w = AdaptiveWait(0.08)
    for met in outcomes:
        w.on_latency(100.0 if met else 400.0, 300.0)
    assert w.allowed_s * 1e3 == pytest.approx(allowed_ms)
    assert w.state() == WaitState(w.allowed_s, None, outcomes.count(False), outcomes.count(True))


def test_latency_equal_to_the_sla_meets_it():
    w = AdaptiveWait(0.08)
    w.on_latency(300.0, 300.0)
    assert (w.met, w.breaches) == (1, 0)


# arrivals at 0, 20, 40 ms: mean gap 20 ms, next expected at 60 ms
@pytest.mark.parametrize(
    "allowed_s, now, since, free, want",
    [
        (0.08, 0.040, 0.040, 3, 0.020),  # mate due in 20 ms, 80 ms of slack: wait until it is due
        (0.08, 0.050, 0.040, 3, 0.010),  # 10 ms later: 10 ms left to its due time
        (0.015, 0.040, 0.040, 3, 0.0),  # due after the slack ends: start now
        (0.08, 0.040, 0.040, 0, 0.0),  # the batch is full: start now
        (0.08, 0.130, 0.040, 3, 0.0),  # the oldest already waited past the slack
        (0.08, 0.070, 0.040, 3, 0.020),  # overdue: one more mean gap from now, within the 50 ms left
        (0.08, 0.110, 0.040, 3, 0.0),  # overdue and only 10 ms left: start now
        (0.0, 0.040, 0.040, 3, 0.0),  # no slack: never wait
    ],
)
def test_wait_decision(allowed_s, now, since, free, want):
    assert primed(allowed_s).wait_s(now, since, free) == pytest.approx(want)


def test_sparse_arrivals_never_wait():
    # one request every second against an 80 ms budget: nobody is expected in time
    w = primed(0.08, arrivals=(0.0, 1.0, 2.0, 3.0))
    assert w.wait_s(3.0, 3.0, 3) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_wait_s": -1.0},
        {"max_wait_s": 0.05, "initial_wait_s": 0.06},
        {"max_wait_s": 0.05, "decrease": 1.0},
        {"max_wait_s": 0.05, "gap_alpha": 0.0},
        {"max_wait_s": 0.05, "increase_s": -0.01},
    ],
)
def test_bad_settings_are_refused_with_their_name(kwargs):
    bad = next(k for k in kwargs if k != "max_wait_s") if len(kwargs) > 1 else "max_wait_s"
    with pytest.raises(ValueError, match=bad):
        AdaptiveWait(**kwargs)
