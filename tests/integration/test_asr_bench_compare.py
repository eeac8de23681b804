"""``edge-agent bench asr --compare``: the fixed-wait and adaptive configurations side by side in one run."""

from __future__ import annotations

import json

import pytest

from edge_agent.cli import main
from tests.speech import speech_wav


@pytest.mark.slow
def test_bench_asr_compare_runs_both_configurations_side_by_side(tmp_path, capsys):
    wav = speech_wav("turn on the lights", lead_s=0.3, tail_s=0.7)
    out = tmp_path / "cmp.json"
    args = ["bench", "asr", "--compare", "--streams", "1,2", "--model", "demo-ctc", "--rounds", "1"]
    code = main([*args, "--audio", str(wav), "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["streams"]) == {"1", "2"}
    for cols in report["streams"].values():
        for config in ("fixed", "adaptive"):
            assert cols[config]["final_ms"]["count"] >= 1 and cols[config]["first_partial_ms"]["p50"] > 0
            assert cols[config]["final_text_equal_fraction"] == 1.0  # the CTC final is the one-pass text
    assert "fixed/adapt" in table and "first_partial_ms p95" in table and "2 stream(s)" in table
