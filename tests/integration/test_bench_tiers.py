"""`bench tiers` end to end on the real demo ladders (demo-phi3-small above demo-phi3; demo-whisper above demo-asr)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from edge_agent.bench.ramp import arrivals, rate_at
from edge_agent.cli import main


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
    code = main(
        [
            "bench",
            "tiers",
            "--duration-s",
            "14",
            "--max-new-tokens",
            "16",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--quiet",
        ]
    )
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


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("espeak-ng") and shutil.which("sox")),
    reason="bench tiers --workload asr synthesises its streams with espeak-ng and sox",
)
def test_bench_tiers_asr_replays_the_same_arrivals_on_both_arms_and_fails_no_stream(tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    code = main(
        ["bench", "tiers", "--workload", "asr", "--duration-s", "10", "--json", str(out), "--plot", str(png), "--quiet"]
    )
    report = json.loads(out.read_text())
    assert code == 0
    assert report["workload"] == "asr" and report["tiers"] == ["demo-whisper", "demo-asr"]
    assert report["streams"] == len(report["arrivals"]) > 0 and report["arrivals"] == sorted(report["arrivals"])
    for side in ("adaptive", "fixed"):
        run = report[side]
        assert run["failed"] == 0 and run["errors"] == []
        assert run["started"] + run["shed"] == report["streams"] and run["finished"] == run["started"]
        # both arms ran on the same arrival times
        offered = sorted([s["t_s"] for s in report["stream_log"][side]] + report["shed_at"][side])
        assert offered == pytest.approx(report["arrivals"], abs=1e-3)
        for key in ("first_partial_p50_ms", "first_partial_p95_ms", "first_partial_p99_ms", "time_over_target_s"):
            assert run[key] is not None and math.isfinite(run[key]) and run[key] >= 0
    assert set(report["fixed"]["served_by_tier"]) == {"demo-whisper"}
    for s in report["switches"]:
        assert s["workload"] == "asr" and s["reason"] and s["from"] != s["to"]
        assert {s["from"], s["to"]} <= set(report["tiers"]) and math.isfinite(s["t_s"])
    ratio = report["over_target_ratio"]
    assert ratio is None or math.isfinite(ratio)
    assert png.stat().st_size > 1000
    assert "time over target adaptive/fixed" in capsys.readouterr().out
