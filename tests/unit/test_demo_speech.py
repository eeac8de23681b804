"""The demo's speech: Whisper base hears the natural voices in turn; without it demo-asr hears espeak-ng,
the only speech it was trained on; without speech no ASR tier."""

from __future__ import annotations

import numpy as np

from edge_agent.config import load_settings
from edge_agent.demo import speech
from edge_agent.engines import voices as V


def _tiers(tmp_path, text: str):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return [(t.name, t.model) for t in load_settings(path).models.asr]


def test_the_asr_tier_is_whisper_base_on_real_weights_else_demo_asr_else_none(tmp_path):
    assert _tiers(tmp_path, speech.asr_toml(True, True)) == [("whisper-base", "whisper-base")]
    assert _tiers(tmp_path, speech.asr_toml(True, False)) == [("demo-asr", "demo-asr")]
    assert _tiers(tmp_path, speech.asr_toml(False, True)) == []


def test_natural_voices_speak_in_turn_and_espeak_ng_stands_in_when_they_are_missing(tmp_path, monkeypatch):
    said = [("turn on the kitchen light", "en"), ("what time is it", "en+f2"), ("set a timer", "en-us")]
    monkeypatch.setattr(V, "missing", lambda voices: [])
    monkeypatch.setattr(V, "synthesize", lambda items: [np.full(800, 0.1, np.float32) for _ in items])
    made, note = speech.clips(tmp_path, said, natural=True)
    assert [t for _, t in made] == [t for t, _ in said] and all(p.is_file() for p, _ in made)
    assert note.endswith(", ".join(v.label for v in V.STANDARD[:3]))
    monkeypatch.setattr(V, "missing", lambda voices: ["piper-tts"])
    monkeypatch.setattr("edge_agent.audio.spoken.synthesize", lambda workdir, pairs: [(tmp_path / "x.wav", "t")])
    made, note = speech.clips(tmp_path, said, natural=True)
    assert made == [(tmp_path / "x.wav", "t")] and note == "espeak-ng voices: en, en+f2, en-us"
