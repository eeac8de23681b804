"""bench calls --speech: commands spoken by the voice set in turn, each heard with or without the tools'
words as context (a fake recogniser records what it was told)."""

from __future__ import annotations

import numpy as np

from edge_agent.bench import calls
from edge_agent.demo_models.home_commands import HELD_OUT
from edge_agent.engines import voices as V


class _Heard:
    def __init__(self, with_context: bool) -> None:
        self.told: list[str] = []
        if with_context:
            self.context_ids = lambda text: [1]

    def transcribe(self, audio, context: str = ""):
        self.told.append(context)
        return type("H", (), {"text": f" {audio.size} "})()


def test_commands_are_spoken_by_the_voices_in_turn(monkeypatch):
    said = []

    def fake(items, progress=None):
        said.extend(items)
        return [np.zeros(100 + i, np.float32) for i in range(len(items))]

    monkeypatch.setattr(V, "synthesize", fake)
    commands, audio, labels = calls.spoken(HELD_OUT[:5], V.STANDARD[:3])
    assert [v for _, v in said] == [V.STANDARD[i % 3] for i in range(5)]
    assert [t for t, _ in said] == [c.text for c in HELD_OUT[:5]]
    assert labels == [V.STANDARD[i % 3].label for i in range(5)] and len(audio) == 5
    assert list(commands) == list(HELD_OUT[:5])


def test_every_voice_says_every_command(monkeypatch):
    said = []

    def fake(items, progress=None):
        said.extend(items)
        return [np.zeros(100, np.float32) for _ in items]

    monkeypatch.setattr(V, "synthesize", fake)
    commands, audio, labels = calls.spoken(HELD_OUT[:2], V.STANDARD[:3], every_voice=True)
    expected = [(c, v) for c in HELD_OUT[:2] for v in V.STANDARD[:3]]
    assert said == [(c.text, v) for c, v in expected]
    assert list(commands) == [c for c, _ in expected] and labels == [v.label for _, v in expected]
    assert len(audio) == 6


def test_heard_by_pads_the_speech_and_tells_the_context_only_to_a_recogniser_that_takes_one():
    speech = np.ones(1000, np.float32)
    r = _Heard(True)
    assert calls.heard_by(r, speech, "kitchen") == str(1000 + 3 * int(0.4 * 16000))
    assert r.told == ["kitchen"]
    plain = _Heard(False)
    calls.heard_by(plain, speech, "kitchen")
    assert plain.told == [""]
