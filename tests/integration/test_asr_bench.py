"""``edge-agent bench asr``: streaming and one-pass figures side by side in one run, JSON and plot."""

from __future__ import annotations

import json

import pytest

from edge_agent.cli import main
from tests.speech import speech_wav


@pytest.mark.slow
def test_bench_asr_reports_streaming_and_baseline(tmp_path, capsys):
    wav = speech_wav("turn on the lights", lead_s=0.3, tail_s=0.7)
    out, png = tmp_path / "asr.json", tmp_path / "asr.png"
    code = main(
        [
            "bench",
            "asr",
            "--streams",
            "2",
            "--model",
            "demo-ctc",
            "--rounds",
            "1",
            "--audio",
            str(wav),
            "--batch-timeout-ms",
            "20",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    table = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.read_text())
    assert report["streams"] == 2 and report["utterances_per_stream"] == 1
    for side in ("streaming", "baseline"):
        for metric in ("final_ms", "rtf", "first_text_ms"):
            assert report[side][metric]["count"] == 2 and report[side][metric]["p50"] > 0
    assert report["streaming"]["first_partial_ms"]["count"] == 2
    assert report["baseline"]["first_partial_ms"]["count"] == 0
    # the stateless CTC final is the whole-utterance pass: streaming and one pass agree exactly
    assert report["final_text_equal_fraction"] == 1.0
    assert report["batching"]["batches"] > 0
    assert "streaming" in table and "one pass" in table and "first_text_ms p50" in table
    assert png.stat().st_size > 10_000
