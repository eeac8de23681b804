"""Spoken commands synthesised on the spot (espeak-ng + sox), for the demo and ``bench tiers --workload asr``.

Several voices, so that a recogniser is not measured on one speaker; 16 kHz mono PCM16 WAVs with a
little silence around each command, as an endpointer expects. Nothing is synthesised (an empty list)
when either tool is missing: the callers then run without speech or say what to install.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

SPOKEN = (
    "turn on the kitchen light",
    "set the bedroom temperature to twenty one degrees",
    "what time is it",
    "set a timer for five minutes",
    "turn off all the lights",
)
VOICES = ("en", "en+m3", "en+f2", "en-us", "en+m7")


def synthesize(workdir: Path, said: Sequence[tuple[str, str]] | None = None) -> list[tuple[Path, str]]:
    """Spoken commands as 16 kHz mono WAVs (espeak-ng + sox); [] when not installed. ``said``: (text, voice)
    pairs; default ``SPOKEN`` in turn in ``VOICES``."""
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        return []
    pairs = said if said is not None else [(t, VOICES[i % len(VOICES)]) for i, t in enumerate(SPOKEN)]
    out = []
    for i, (text, voice) in enumerate(pairs):
        raw, wav = workdir / f"say{i}.raw.wav", workdir / f"say{i}.wav"
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", "150", "-w", str(raw), text],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav), "pad", "0.2", "0.6"],
            check=True,
            capture_output=True,
        )
        out.append((wav, text))
    return out
