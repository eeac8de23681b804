"""Calibration and held-out manifests (JSONL), read with errors that name the file and line.

Text (LLM): one object per line, ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}]}``.
Audio (ASR): ``{"audio": "path relative to the manifest", "text": "reference (optional for calibration)"}``.
A line may carry a ``"synth"`` recipe instead of a recorded file: its WAV is made with espeak-ng on
first use (``synth_audio``), beside the manifest or, for the shipped manifests, under the cache.

A calibration set that is empty, or whose every line is broken, is refused: a quantizer fed
nothing produces ranges of zero and an engine that outputs garbage.

``--data`` may also name a capture directory (``[calibration] capture_dir``, written by
``serving/capture.py``): its ``llm.jsonl`` or ``asr.jsonl`` is the manifest (``capture_manifest``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

CAPTURE_LLM, CAPTURE_ASR = "llm.jsonl", "asr.jsonl"  # a capture directory's manifests


def capture_manifest(path: Path, workload: str) -> Path:
    """``path`` itself when it is a file; for a directory, its manifest for ``workload`` (``llm`` or ``asr``)."""
    if not path.exists():
        raise InputError(f"{path}: calibration data not found (a manifest file or a capture directory)")
    if not path.is_dir():
        return path
    name = CAPTURE_LLM if workload == "llm" else CAPTURE_ASR
    manifest = path / name
    if not manifest.is_file():
        raise InputError(
            f"{path}: a directory given as calibration data needs {name} inside (a capture directory, "
            f"[calibration] capture_dir); none is there yet"
        )
    return manifest


@dataclass(frozen=True, slots=True)
class TextSample:
    """One LLM record of a manifest: a raw prompt or chat messages, with its line number."""

    line: int
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None


@dataclass(frozen=True, slots=True)
class AudioSample:
    """One ASR record of a manifest: the audio file and its transcript, with its line number."""

    line: int
    audio: Path
    text: str | None


def _lines(path: Path) -> list[tuple[int, dict]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: calibration manifest not found") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); is it a JSONL manifest?") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(item, dict):
            raise InputError(f"{path}:{number}: expected a JSON object, got {type(item).__name__}")
        records.append((number, item))
    if not records:
        raise InputError(
            f"{path}: the manifest is empty; calibration needs representative samples (see calibration/README.md)"
        )
    return records


def read_text_manifest(path: Path, limit: int | None = None) -> list[TextSample]:
    out = []
    for number, item in _lines(path):
        if isinstance(item.get("prompt"), str):
            if not item["prompt"].strip():
                raise InputError(f'{path}:{number}: "prompt" is empty')
            out.append(TextSample(number, item["prompt"], None))
        elif isinstance(item.get("messages"), list) and item["messages"]:
            msgs = []
            for m in item["messages"]:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise InputError(f'{path}:{number}: each message needs "role" and "content" strings')
                msgs.append((m["role"], m["content"]))
            out.append(TextSample(number, None, tuple(msgs)))
        else:
            raise InputError(
                f'{path}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}}; got keys {sorted(item)}'
            )
        if limit and len(out) >= limit:
            break
    return out


def _with_audio(path: Path, limit: int | None) -> tuple[Path, list[tuple[int, dict]]]:
    """The manifest's lines, and where their audio is (synthesised audio for the first ``limit`` made now)."""
    from .synth_audio import materialise

    records = _lines(path)
    return materialise(path, records[: limit or None]), records


def read_audio_manifest(path: Path, limit: int | None = None, need_text: bool = False) -> list[AudioSample]:
    out = []
    path, records = _with_audio(path, limit)
    for number, item in records:
        audio = item.get("audio")
        if not isinstance(audio, str) or not audio:
            raise InputError(f'{path}:{number}: expected {{"audio": "relative/path.wav", "text": "..."}}')
        text = item.get("text")
        if need_text and not isinstance(text, str):
            raise InputError(f'{path}:{number}: no reference "text" (the accuracy gate scores {audio} against it)')
        file = (path.parent / audio).resolve()
        if not file.is_file():
            raise InputError(f"{path}:{number}: audio file {audio} not found at {file}")
        out.append(AudioSample(number, file, text if isinstance(text, str) else None))
        if limit and len(out) >= limit:
            break
    return out


def manifest_digest(path: Path, limit: int | None = None) -> str:
    """sha256 over the manifest and, for audio manifests, the audio files it names (part of cache keys)."""
    h = hashlib.sha256()
    h.update(path.read_bytes())
    h.update(str(limit).encode())
    if any(isinstance(item.get("audio"), str) for _, item in _lines(path)):
        path = _with_audio(path, limit)[0]  # the audio is part of the key: make it before hashing it
    for _, item in _lines(path)[: limit or None]:
        audio = item.get("audio")
        if isinstance(audio, str):
            file = path.parent / audio
            if file.is_file():
                h.update(hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()
