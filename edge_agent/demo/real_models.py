"""The real models the demo serves: Gemma 3 270M with the home-commands adapter for the LLM tiers and
OpenAI's Whisper base for the voice tier, each fetched on first use and its recipe's engines built and gated
once for this machine (as ``models fetch`` does), then found in the cache. Where one cannot be had, the demo
says how to get it and goes on with the random demo models (LLM) or demo-asr (speech)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config.tiers import DEFAULT_ASR_MODEL, DEFAULT_LLM_MODEL
from ..errors import EdgeAgentError
from .speech import DEMO_ASR

REAL_MODEL = DEFAULT_LLM_MODEL


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


def real_model(models_dir: Path, say) -> tuple[bool, str]:
    """Whether the real model is here, fetched on first use with its engines built (the recipe's gate's
    choice, cached), and a one-line note (how to get it if not)."""
    error, summary, fetched = fetch_and_build(
        REAL_MODEL, "model.onnx", "Gemma 3 270M and its home-commands adapter, about 250 MB", models_dir, say
    )
    if error is not None:
        return False, (
            f"no real model ({error}); the LLM tiers are random demo models: "
            f"get it with `edge-agent models fetch {REAL_MODEL}`"
        )
    chosen = summary["chosen"] if summary else None
    served = f"its {chosen['backend']}/{chosen['precision']} engine" if chosen else "the FP32 folder: no engine passed"
    return True, f"LLM tiers on {REAL_MODEL} (real weights{fetched}; {served})"
