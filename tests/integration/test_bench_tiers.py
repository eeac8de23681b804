"""`bench tiers` end to end on the real demo ladder (demo-phi3-small above demo-phi3)."""
from __future__ import annotations

import json

import pytest

from edge_agent.cli import main
from edge_agent.bench.tiers import arrivals, rate_at


def test_arrivals_follow_the_rise_hold_fall_profile():
    times = arrivals(200.0, 1.0, 10.0, seed=3)
    assert times == sorted(times) and times == arrivals(200.0, 1.0, 10.0, seed=3)
    hold = [t for t in times if 50 <= t < 120]  # the hold phase at 10/s
    tail = [t for t in times if 170 <= t < 200]  # the tail at 1/s
    assert 10 * 70 * 0.85 < len(hold) < 10 * 70 * 1.15
    assert 30 * 0.5 < len(tail) < 30 * 1.6
    assert rate_at(0, 200, 1, 10) == 1 and rate_at(60, 200, 1, 10) == 10 and rate_at(199, 200, 1, 10) == 1


@pytest.mark.slow
def test_bench_tiers_switches_down_under_the_peak_and_fails_no_request(tmp_path, capsys):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    code = main(["bench", "tiers", "--duration-s", "14", "--max-new-tokens", "16", "--json", str(out),
                 "--plot", str(png), "--quiet"])
    report = json.loads(out.read_text())
    assert code == 0
    for side in ("adaptive", "fixed"):
        run = report[side]
        assert run["failed"] == 0 and run["completed"] + run["shed"] == report["requests"]
    assert report["switches"], "a 5x peak over the top tier's single-request rate must cause a downgrade"
    first = report["switches"][0]
    assert first["from"] == "demo-phi3-small" and first["to"] == "demo-phi3" and first["action"] == "downgrade"
    assert first["snapshot"]["value_ms"] > report["target_ms"]
    assert report["adaptive"]["served_by_tier"].get("demo-phi3", 0) > 0
    assert len(report["timeline"]) == 14 and png.stat().st_size > 1000
    assert "time over target adaptive/fixed" in capsys.readouterr().out
