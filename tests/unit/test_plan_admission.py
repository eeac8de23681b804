from __future__ import annotations

import pytest

from edge_agent.serving.llm.scheduler import Limits, plan_admission

L = Limits(max_batch=4, batch_timeout_ms=80, preferred_batch_sizes=(2, 4))


@pytest.mark.parametrize(
    "waiting, running, now, expected",
    [
        ([], 0, 0.0, (0, None)),  # nothing to do
        ([0.0], 0, 0.010, (0, 0.080)),  # idle engine, one request: wait for company up to 80 ms
        ([0.0], 0, 0.080, (1, None)),  # ... and no longer
        ([0.0, 0.01], 0, 0.011, (2, None)),  # a preferred size: go now
        ([0.0, 0.01, 0.02], 0, 0.03, (0, 0.080)),  # 3 is not preferred and below max: wait for a 4th
        ([0.0] * 6, 0, 0.0, (4, None)),  # a full batch never waits
        ([0.0, 0.01, 0.02], 1, 0.03, (3, None)),  # sequences decoding: newcomers join at the next step
        ([0.0, 0.01], 3, 0.02, (1, None)),  # only as many as there is room for
        ([0.0], 4, 5.0, (0, None)),  # full: nothing, however long they waited
    ],
)
def test_plan_admission(waiting, running, now, expected):
    n, wake = plan_admission(waiting, running, now, L)
    assert n == expected[0]
    assert wake == pytest.approx(expected[1]) if expected[1] is not None else wake is None


def test_an_adaptive_wait_starts_a_lone_request_at_once_when_nobody_is_expected():
    from edge_agent.serving.batch_wait import AdaptiveWait

    wait = AdaptiveWait(0.080)
    for t in (0.0, 1.0, 2.0):  # one request a second: a batch-mate is never expected within 80 ms
        wait.observe_arrival(t)
        wait.on_latency(50.0, 387.0)
    assert plan_admission([2.0], 0, 2.0, L, wait) == (1, None)


def test_an_adaptive_wait_holds_for_an_expected_batch_mate_but_never_past_the_timeout():
    from edge_agent.serving.batch_wait import AdaptiveWait

    wait = AdaptiveWait(0.080, initial_wait_s=0.080)
    for i in range(20):  # one arrival every 20 ms: the next is due before the wait runs out
        wait.observe_arrival(i * 0.020)
    last = 19 * 0.020
    n, wake = plan_admission([last], 0, last, L, wait)
    assert n == 0 and last < wake <= last + 0.080
    assert plan_admission([last], 0, last + 0.081, L, wait) == (1, None)  # the timeout still bounds it
