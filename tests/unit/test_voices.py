"""The voices every speech measure speaks with: specs parsed (bad ones named in one line), recipes that
round-trip, the standard set's engines, and where the synthesisers are installed the speech itself:
16 kHz, levelled to a peak of 0.5, about as long as the words take (flite and espeak-ng are
deterministic: the same samples twice)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_agent.engines import voices as V
from edge_agent.errors import InputError


def test_specs_parse_and_label_each_voice():
    assert V.parse_voice("piper:joe") == V.Voice("piper", "joe", 1.0, 0.667)
    assert V.parse_voice("piper:joe:0.85:0.3") == V.Voice("piper", "joe", 0.85, 0.3)
    assert V.parse_voice("flite:slt").label == "flite slt"
    assert V.parse_voice("espeak-ng:en-us") == V.STRESS
    assert V.parse_voice("piper:joe:1.15:0.9").label == "piper joe ×1.15 n0.9"
    for v in V.STANDARD:
        assert V.parse_voice(v.spec) == v


@pytest.mark.parametrize(
    "spec", ["", "piper", "piper:bob", "piper:joe:fast", "piper:joe:9", "flite:kal", "flite:slt:1", "say:hi"]
)
def test_bad_specs_are_one_line_naming_them(spec):
    with pytest.raises(InputError) as err:
        V.parse_voice(spec)
    assert "\n" not in str(err.value) and repr(spec) in str(err.value)


def test_named_sets_and_lists():
    assert V.parse_voices("standard") == V.STANDARD
    assert V.parse_voices("natural,stress") == V.STANDARD  # duplicates dropped, order kept
    assert V.parse_voices("flite:slt, piper:joe") == (V.Voice("flite", "slt"), V.Voice("piper", "joe"))
    assert {v.engine for v in V.NATURAL} == {"piper", "flite"} and V.STRESS.engine == "espeak"
    with pytest.raises(InputError):
        V.parse_voices(" , ")


def test_recipes_round_trip_and_are_told_from_the_training_synthesisers():
    for v in V.STANDARD:
        r = V.recipe(v, 0.25, 0.5)
        assert V.is_voice_recipe(r)
        assert V.from_recipe(r) == (v, 0.25, 0.5)
    espeak_training = {"voice": "en-us+max", "speed_wpm": 150, "pitch": 40}
    assert not V.is_voice_recipe(espeak_training)
    with pytest.raises((KeyError, ValueError)):
        V.from_recipe({"engine": "piper", "voice": "joe"})


def _duration_ok(x: np.ndarray, words: int) -> bool:
    return 0.15 * words < x.size / V.RATE < 1.0 * words + 0.5


@pytest.mark.skipif(not (shutil.which("flite") and shutil.which("sox")), reason="flite or sox not installed")
def test_flite_voices_speak_levelled_16k_speech_the_same_twice():
    text = "turn on the kitchen light"
    items = [(text, V.Voice("flite", n)) for n in V.FLITE_VOICES]
    first, second = V.synthesize(items), V.synthesize(items)
    for a, b in zip(first, second):
        assert a.dtype == np.float32 and abs(float(np.max(np.abs(a))) - 0.5) < 1e-6
        assert _duration_ok(a, 5)
        np.testing.assert_array_equal(a, b)
    padded = V.pad(first[0], 0.3, 0.5)
    assert padded.size == first[0].size + int(0.3 * V.RATE) + int(0.5 * V.RATE)
    assert not np.any(padded[: int(0.3 * V.RATE)])


def test_missing_synthesisers_are_named_with_how_to_get_them(monkeypatch):
    monkeypatch.setattr(V.shutil, "which", lambda name: None)
    monkeypatch.setattr(V.importlib.util, "find_spec", lambda name: None)
    gaps = V.missing(V.STANDARD)
    assert any("piper-tts" in g for g in gaps) and any("apt install flite" in g for g in gaps)
    assert any("apt install espeak-ng" in g for g in gaps)
    with pytest.raises(InputError, match="needs"):
        V.require([V.Voice("flite", "slt")])


def test_a_piper_voice_file_other_than_the_pinned_one_is_refused_by_name(tmp_path, monkeypatch):
    fake = tmp_path / "en_US-joe-medium.onnx"
    fake.write_bytes(b"not the voice")
    monkeypatch.setattr(V, "piper_model", lambda name="joe": fake)
    with pytest.raises(InputError) as err:
        V._pinned("joe")
    assert str(fake) in str(err.value) and "pinned" in str(err.value)
    import hashlib

    monkeypatch.setitem(V.PIPER_SHA256, "joe", hashlib.sha256(b"not the voice").hexdigest())
    assert V._pinned("joe") == fake
