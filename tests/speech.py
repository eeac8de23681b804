"""Speech for tests, synthesised at test time with espeak-ng and sox (apt: espeak-ng sox).

``speech_wav(text)`` returns a 16 kHz mono 16-bit WAV of ``text`` with silence around it, made once
per test session and cached (synthesis takes well under a second). Tests that need it skip with
the reason when the tools are missing.
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

_DIR: Path | None = None


def _dir() -> Path:
    global _DIR
    if _DIR is None:
        _DIR = Path(tempfile.mkdtemp(prefix="edge-agent-speech-"))
        atexit.register(shutil.rmtree, _DIR, True)
    return _DIR


def have_tools() -> bool:
    return shutil.which("espeak-ng") is not None and shutil.which("sox") is not None


def require_tools() -> None:
    if not have_tools():
        pytest.skip("speech synthesis needs espeak-ng and sox (apt install espeak-ng sox)")


def speech_wav(
    text: str,
    voice: str = "en-us",
    *,
    rate: int = 16000,
    channels: int = 1,
    bits: int = 16,
    encoding: str = "signed-integer",
    lead_s: float = 0.4,
    tail_s: float = 0.8,
    wpm: int = 160,
) -> Path:
    """A WAV of ``text`` (cached per session). ``voice`` as espeak-ng takes it (``en+max``, …)."""
    require_tools()
    recipe = (text, voice, rate, channels, bits, encoding, lead_s, tail_s, wpm)
    key = hashlib.sha1(repr(recipe).encode()).hexdigest()[:16]
    out = _dir() / f"{key}.wav"
    if out.is_file():
        return out
    raw = _dir() / f"{key}.raw.wav"
    subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(raw), text], check=True, capture_output=True, timeout=30
    )
    subprocess.run(
        [
            "sox",
            str(raw),
            "-r",
            str(rate),
            "-c",
            str(channels),
            "-b",
            str(bits),
            "-e",
            encoding,
            str(out),
            "pad",
            str(lead_s),
            str(tail_s),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    raw.unlink()
    return out


def speech_samples(text: str, voice: str = "en-us", **kw) -> np.ndarray:
    """float32 16 kHz mono samples of ``text``."""
    import soundfile

    data, rate = soundfile.read(str(speech_wav(text, voice, **kw)), dtype="float32")
    assert rate == 16000
    return data


def two_utterances(first: str, second: str, gap_s: float = 1.2) -> np.ndarray:
    """Two sentences separated by ``gap_s`` of silence (one stream, two utterances)."""
    a = speech_samples(first, tail_s=0.0)
    b = speech_samples(second, lead_s=0.0)
    return np.concatenate([a, np.zeros(int(gap_s * 16000), np.float32), b])
