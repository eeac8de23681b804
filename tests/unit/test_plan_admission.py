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
