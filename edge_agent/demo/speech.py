"""The demo's speech: who speaks its commands and which recogniser hears them.

On real weights the voice tier is OpenAI's Whisper base (fetched on first use, like the LLM) and the
commands are spoken by the natural-voice set in turn (``engines/voices.py``: Piper's joe at three
length/noise settings, flite slt/rms/awb/kal16, espeak-ng en-us as the stress voice). Where Whisper base
cannot be had, or with ``--random-models``, the small demo-asr model hears espeak-ng (the only speech it
was trained on) in each command's own voice; where no synthesiser is installed there is no speech.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..config.tiers import DEFAULT_ASR_MODEL
from ..errors import EdgeAgentError

DEMO_ASR = "demo-asr"


def fetch_and_build(name: str, marker: str, about: str, models_dir: Path, say: Callable[[str], None]):
    """``name`` fetched on first use (``marker``: a file its imported folder has once it is here) and its
    recipe's engines built (the gate's choice, cached): (error or None, the build's decision or None, ", fetched
    now" or ""). A build that fails leaves the folder to serve."""
    from ..config import load_settings
    from ..engines.machine_build import build_recipe
    from ..importers.fetch import fetch
    from ..importers.result import imported_dir

    fetched = ""
    if not (imported_dir(models_dir) / name / marker).is_file():
        say(f"first run: fetching {name} ({about})")
        try:
            fetch(name, models_dir, say=say)
        except EdgeAgentError as exc:
            return exc, None, ""
        fetched = ", fetched now"
    # built as `models fetch` builds it: once, then found in the cache (the default settings' cache: the one
    # the demo's daemon reads)
    say(f"the engines of {name}'s recipe (built and gated once for this machine, then cached)")
    try:
        return None, build_recipe(name, load_settings(None)), fetched
    except EdgeAgentError as exc:
        say(f"the {name} engines could not be built ({exc}); its FP32 folder serves")
        return None, None, fetched


def real_asr(models_dir: Path, say: Callable[[str], None]) -> tuple[bool, str]:
    """Whether Whisper base is here, fetched on first use with its recipe's engines built (the gate's
    choice, cached), and a one-line note (how to get it if not)."""
    error, summary, fetched = fetch_and_build(
        DEFAULT_ASR_MODEL, "encoder_model.onnx", "OpenAI's Whisper base, about 140 MB", models_dir, say
    )
    if error is not None:
        return False, f"no {DEFAULT_ASR_MODEL} ({error}); speech heard by {DEMO_ASR} (espeak-ng voices only)"
    chosen = summary["chosen"] if summary else None
    served = f"its {chosen['precision']} engine" if chosen else "its FP32 folder"
    return True, f"ASR tier {DEFAULT_ASR_MODEL} (real weights{fetched}; {served})"


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
