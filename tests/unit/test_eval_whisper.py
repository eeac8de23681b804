"""eval asr on a Whisper model: WER counted over words (hand-computed), per voice as the manifest names
them, both modes; a run on demo-whisper (random weights: the plumbing, not the accuracy) and its text."""

from __future__ import annotations

import json

import numpy as np

from edge_agent.bench.eval_whisper import _rates, evaluate_whisper, format_whisper_report


def test_rates_count_words_and_exact_sentences_by_hand():
    rows = [
        {"ref": "turn on the light", "full": "Turn on the lights."},  # 1 substitution
        {"ref": "set a timer", "full": "set timer"},  # 1 deletion
        {"ref": "hello", "full": "hello"},
    ]
    r = _rates(rows, "full")
    assert r["wer"]["ref_len"] == 8 and r["wer"]["substitutions"] == 1 and r["wer"]["deletions"] == 1
    assert abs(r["wer"]["rate"] - 2 / 8) < 1e-12
    assert (r["exact"], r["of"]) == (1, 3)
    assert rows[0]["full"] == "turn on the lights"  # normalized in place, as the report shows them


def test_a_run_on_demo_whisper_reports_each_voice_and_mode(tmp_path):
    from edge_agent.audio.wav import write_wav
    from edge_agent.models.catalog import resolve_model

    rng = np.random.default_rng(0)
    lines = []
    for i, voice in enumerate(["flite slt", "piper joe ×1 n0.667", "flite slt"]):
        write_wav(tmp_path / f"{i}.wav", (rng.standard_normal(8000 + 4000 * i) * 0.05).astype(np.float32))
        lines.append({"audio": f"{i}.wav", "text": "turn on the light", "voice": voice})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ref = resolve_model("demo-whisper", tmp_path / "models")
    report = evaluate_whisper(ref, manifest, prompt="kitchen light")
    assert report["voices"] == ["flite slt", "piper joe ×1 n0.667"]
    assert (
        report["per_voice"]["flite slt"]["full"]["of"] == 2
        and report["per_voice"]["piper joe ×1 n0.667"]["full"]["of"] == 1
    )
    assert set(report["results"]) == {"full", "stream"} and report["utterances"] == 3
    assert report["results"]["full"]["wer"]["ref_len"] == 12
    assert report["latency"]["final_ms_p95"] >= report["latency"]["final_ms_p50"] >= 0
    text = format_whisper_report(report)
    assert "prompt 'kitchen light'" in text and "piper joe ×1 n0.667" in text and "end of audio → final" in text
