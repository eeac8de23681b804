"""``edge-agent bench voice``: a tiny run (two commands, one with a pause, one round) on the demo models:
the report's keys and structure for both sides, ratios that are positive numbers, each run judged against
its command's expected call, the table and the plot."""

from __future__ import annotations

import json

import pytest

from edge_agent.cli import main
from tests.speech import require_tools

TIMES = ("turn_first_token_ms", "turn_complete_ms", "endpoint_ms")


@pytest.mark.slow
def test_bench_voice_reports_default_and_baseline(tmp_path, capsys):
    require_tools()
    out, png = tmp_path / "voice.json", tmp_path / "voice.png"
    code = main(
        [
            "bench",
            "voice",
            "--utterances",
            "2",
            "--rounds",
            "1",
            "--llm-model",
            "demo-phi3",
            "--voices",
            "own",  # espeak-ng in each command's voice: the demo-asr tier of the tests was trained on it
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    report = json.loads(out.read_text())
    assert report["utterances"] == 2 and report["with_pause"] == 1 and report["rounds"] == 1
    for side in (report, report["baseline"]):
        for metric in TIMES:
            assert set(side[metric]) == {"p50", "p95"}
            assert all(isinstance(v, float) for v in side[metric].values())
            for stat in ("p50", "p95"):  # one round: its range is the value itself
                assert side["spread"][metric][stat] == [side[metric][stat]] * 2
        assert set(side["false_cuts"]) == {"count", "rate", "of"} and side["false_cuts"]["of"] == 1
        assert isinstance(side["duplicated_calls"], int) and isinstance(side["hit_tokens"], int)
        # judged against each command's expected call (random weights: whatever the count, it is counted)
        assert side["calls_right"]["of"] == 2 and 0 <= side["calls_right"]["count"] <= 2
        assert len(side["wrong"]) == 2 - side["calls_right"]["count"]
    assert "prefix_cache.enabled" in report["toggles"] and isinstance(report["missing"], list)
    assert report["baseline"]["prefills_ahead"] == 0  # the baseline never prefills a partial
    for metric in TIMES:
        for stat in ("p50", "p95"):
            ratio = report["ratios"][metric][stat]
            assert isinstance(ratio, float) and ratio > 0
    # the runs are interleaved: each utterance on both sides, every one a real turn through the LLM
    rows = report["rows"]
    assert [(r["utterance"], r["side"]) for r in rows] == [
        (0, "default"),
        (0, "baseline"),
        (1, "default"),
        (1, "baseline"),
    ]
    assert all(r["heard"] and r["turn_complete_ms"] >= r["turn_first_token_ms"] for r in rows)
    assert [r["expected"]["name"] for r in rows] == ["set_light", "set_light", "set_timer", "set_timer"]
    assert "calls right (name+args)" in captured.out
    assert "turn_complete_ms p50" in captured.out and "default/baseline" in captured.out
    assert captured.err.count("bench voice round 1/1") == 2  # a progress line per utterance
    assert png.stat().st_size > 10_000
