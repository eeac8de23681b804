"""The demo's speech: who speaks its commands and which recogniser hears them.

On real weights the voice tier is OpenAI's Whisper base (fetched on first use, like the LLM) and the
commands are spoken by the natural-voice set in turn (``engines/voices.py``: Piper's joe at three
length/noise settings, flite slt/rms/awb/kal16, espeak-ng en-us as the stress voice). Where Whisper base
cannot be had, or with ``--random-models``, the small demo-asr model hears espeak-ng (the only speech it
was trained on) in each command's own voice; where no synthesiser is installed there is no speech.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config.tiers import DEFAULT_ASR_MODEL

DEMO_ASR = "demo-asr"


def asr_toml(speech: bool, whisper: bool) -> str:
    """The daemon config's ASR tiers: Whisper base, demo-asr, or none (no speech)."""
    if not speech:
        return "[models]\nasr = []\n"
    model = DEFAULT_ASR_MODEL if whisper else DEMO_ASR
    return f'[[models.asr]]\nname = "{model}"\nmodel = "{model}"\n'


def clips(workdir: Path, said: Sequence[tuple[str, str]], natural: bool) -> tuple[list[tuple[Path, str]], str]:
    """The commands as 16 kHz WAVs (0.2 s of silence before, 0.6 s after) and who speaks them: the natural
    voices in turn when ``natural`` and installed, else espeak-ng in each command's own voice ((text,
    espeak-ng voice) pairs), else nothing."""
    from ..audio.spoken import synthesize

    if natural:
        from ..audio.wav import write_wav
        from ..engines import voices

        if not voices.missing(voices.STANDARD):
            who = [voices.STANDARD[i % len(voices.STANDARD)] for i in range(len(said))]
            spoken = voices.synthesize([(text, v) for (text, _), v in zip(said, who)])
            out = []
            for i, ((text, _), x) in enumerate(zip(said, spoken)):
                out.append((write_wav(workdir / f"say{i}.wav", voices.pad(x, 0.2, 0.6)), text))
            return out, "natural voices in turn: " + ", ".join(v.label for v in who)
    made = synthesize(workdir, said)
    return made, ("espeak-ng voices: " + ", ".join(v for _, v in said)) if made else "no speech synthesiser"
