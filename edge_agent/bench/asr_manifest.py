"""ASR evaluation manifests: JSONL, one utterance a line, ``{"audio": "path relative to the manifest",
"text": "reference"}`` (and, for synthesised sets, the ``voice`` that speaks it and its ``synth`` recipe).
Shared by ``eval asr`` for streaming CTC models (``eval_asr.py``) and for Whisper (``eval_whisper.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError


@dataclass(frozen=True, slots=True)
class Utterance:
    """One manifest line: the audio file and its reference text."""

    line: int
    audio: Path
    text: str
    voice: str = ""  # who speaks it: the line's "voice", else its recipe's (``voice_of``)


def read_manifest(path: Path, need_text: bool = True) -> list[Utterance]:
    """Parse a JSONL audio manifest; every problem names the file and line."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise InputError(f"{path}: no such manifest") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the manifest ({exc})") from exc
    items: list[Utterance] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("audio"), str) or not item["audio"]:
            raise InputError(f'{path}:{number}: expected {{"audio": "relative/path.wav", "text": "..."}}')
        text = item.get("text")
        if need_text and not isinstance(text, str):
            raise InputError(f'{path}:{number}: no reference "text" (needed to score {item["audio"]})')
        audio = (path.parent / item["audio"]).resolve()
        if not audio.is_file():
            hint = " (synthesised audio: regenerate it with scripts/asr-eval-audio)" if "synth" in item else ""
            raise InputError(f"{path}:{number}: audio file {item['audio']} not found at {audio}{hint}")
        items.append(Utterance(number, audio, text or "", voice_of(item)))
    if not items:
        raise InputError(f"{path}: the manifest has no utterances")
    return items


def voice_of(item: dict) -> str:
    """A manifest line's voice: its ``voice`` label, else the espeak-ng recipe's voice, else ""."""
    if isinstance(item.get("voice"), str):
        return item["voice"]
    synth = item.get("synth")
    if isinstance(synth, dict) and isinstance(synth.get("voice"), str):
        return f"espeak-ng {synth['voice'].split('+')[0]}" if "engine" not in synth else str(synth["voice"])
    return ""
