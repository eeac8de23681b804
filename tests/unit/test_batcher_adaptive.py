"""The batcher with the adaptive wait: the plan table-tested with a fake clock, then the device thread
(a lone request on an idle device is not held for the configured timeout)."""

from __future__ import annotations

import threading

import pytest

from edge_agent.serving.asr.batcher import Batcher, BatchLimits, BatchPlan, Waiting, take_batch
from edge_agent.serving.batch_wait import AdaptiveWait

L = BatchLimits(max_batch=4, batch_timeout_ms=80.0, preferred_batch_sizes=())
P = BatchLimits(max_batch=4, batch_timeout_ms=80.0, preferred_batch_sizes=(2, 4))


def w(*since, urgent=()):
    return [Waiting(s, i in urgent) for i, s in enumerate(since)]


def rule(allowed_s: float, *arrivals: float) -> AdaptiveWait:
    r = AdaptiveWait(0.08, initial_wait_s=allowed_s)
    for t in arrivals:
        r.observe_arrival(t)
    return r


FRESH = rule(0.0)
BUSY = rule(0.08, 0.0, 0.02, 0.04)  # a request every 20 ms, 80 ms of slack: next due at 60 ms
SPARSE = rule(0.08, 0.0, 1.0, 2.0)  # one a second: nobody due within the slack


@pytest.mark.parametrize(
    "pending, now, limits, wait, plan",
    [
        (w(0.04), 0.04, L, FRESH, BatchPlan(1)),  # idle device, nothing learnt: start at once
        (w(2.0), 2.0, L, SPARSE, BatchPlan(1)),  # nobody expected in time: start at once
        (w(0.04), 0.04, L, BUSY, BatchPlan(0, 0.06)),  # a mate is due at 60 ms: wait for it
        (w(0.04, 0.05), 0.05, L, BUSY, BatchPlan(0, 0.06)),
        (w(0.04), 0.07, L, BUSY, BatchPlan(0, 0.09)),  # overdue: one mean gap more, within the slack
        (w(0.04), 0.11, L, BUSY, BatchPlan(1)),  # overdue with 10 ms of slack left, a gap is 20: go
        (w(0.04), 0.12, L, BUSY, BatchPlan(1)),  # the timeout stays the upper bound
        (w(0.04), 0.04, BatchLimits(batch_timeout_ms=10.0), BUSY, BatchPlan(0, 0.05)),  # even when due later
        (w(0.04), 0.04, L, None, BatchPlan(0, 0.12)),  # no rule: the fixed timeout
        (w(0.04, 0.05), 0.05, P, BUSY, BatchPlan(2)),  # a preferred size goes at once either way
        (w(0.04, urgent=(0,)), 0.04, L, BUSY, BatchPlan(1)),  # so does an end of speech
        (w(0.0, 0.0, 0.0, 0.0), 0.0, L, BUSY, BatchPlan(4)),  # and a full batch
        (w(), 0.0, L, BUSY, BatchPlan(0)),
    ],
)
def test_take_batch_with_the_adaptive_wait(pending, now, limits, wait, plan):
    got = take_batch(pending, now, limits, wait)
    assert got.take == plan.take
    assert got.wake_at_s == (None if plan.wake_at_s is None else pytest.approx(plan.wake_at_s))


def test_the_batcher_adapts_only_when_asked_and_only_with_a_timeout():
    assert Batcher(lambda items: items, BatchLimits(batch_timeout_ms=80)).wait is not None
    assert Batcher(lambda items: items, BatchLimits(batch_timeout_ms=80, adaptive=False)).wait is None
    assert Batcher(lambda items: items, BatchLimits(batch_timeout_ms=0)).wait is None
    b = Batcher(lambda items: items, BatchLimits(batch_timeout_ms=80))
    b.on_latency(100.0, 300.0)
    b.on_latency(100.0, 300.0)
    assert b.wait is not None and b.wait.allowed_s == pytest.approx(0.01)
    Batcher(lambda items: items, BatchLimits(adaptive=False)).on_latency(1e6, 1.0)  # the fixed rule ignores it


def test_a_lone_request_on_an_idle_device_is_not_held_for_the_timeout():
    ran = threading.Event()

    def run(items):
        ran.set()
        return items

    # a one-minute timeout: the fixed rule would hold a lone request that long
    b = Batcher(run, BatchLimits(max_batch=4, batch_timeout_ms=60_000)).start()
    try:
        assert b.submit("a").result(10) == "a"
        assert b.submit("b").result(10) == "b"  # a second arrival, seconds of gap: still nobody expected
    finally:
        b.stop(5)
    assert ran.is_set() and b.batch_sizes == {1: 2}
