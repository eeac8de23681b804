from __future__ import annotations

import io

from edge_agent.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_reports_percent_rate_and_eta_and_throttles():
    clock, out = Clock(), io.StringIO()
    bar = Progress("build", unit="MB", stream=out, clock=clock, min_interval_s=5.0)
    clock.now = 2.0
    bar.update(20, 100)  # 10 MB/s -> 8 s left
    clock.now = 3.0
    bar.update(30, 100)  # within the interval: not printed
    clock.now = 10.0
    bar.update(100, 100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "20.0%" in lines[0] and "10.0 MB/s" in lines[0] and "ETA    8s" in lines[0]
    assert "100.0%" in lines[1]


def test_disabled_progress_prints_nothing():
    out = io.StringIO()
    Progress("x", enabled=False, stream=out).update(1, 2)
    assert out.getvalue() == ""
