"""Calibration and held-out manifests (JSONL), read with errors that name the file and line.

Text (LLM): one object per line, ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}]}``.
Audio (ASR): ``{"audio": "path relative to the manifest", "text": "reference (optional for calibration)"}``.
A line may carry a ``"synth"`` recipe instead of a recorded file: its WAV is made with espeak-ng on
first use (``synth_audio``), beside the manifest or, for the shipped manifests, under the cache.

A line that is not a JSON object (not UTF-8, not JSON: a capture torn by a full disk or a power
loss) is skipped with a warning naming ``file:line`` and counted (``Samples.skipped``); the other
lines are used. A calibration set that is empty, or whose every line is broken, is refused: a
quantizer fed nothing produces ranges of zero and an engine that outputs garbage.

``--data`` may also name a capture directory (``[calibration] capture_dir``, written by
``serving/capture.py``): its ``llm.jsonl`` or ``asr.jsonl`` is the manifest (``capture_manifest``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..errors import InputError

log = logging.getLogger(__name__)

CAPTURE_LLM, CAPTURE_ASR = "llm.jsonl", "asr.jsonl"  # a capture directory's manifests
_NAMED = 5  # skipped lines named one by one in the log; beyond that they are only counted
T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A manifest's JSON objects with their line numbers, and the lines that are not one (number, why)."""

    records: list[tuple[int, dict]]
    bad: list[tuple[int, str]]


class Samples(list[T]):
    """A manifest's records in file order, with ``skipped``: how many of its lines were not a JSON object
    (each named in a warning)."""

    def __init__(self, items: Iterable[T] = (), skipped: int = 0) -> None:
        super().__init__(items)
        self.skipped = skipped


def _lines(path: Path) -> _Parsed:
    """Every JSON object of the manifest. A line that is not one (not UTF-8, not JSON, not an object) is
    set aside in ``bad``, never fatal: a capture torn by a full disk or a power loss leaves such a line
    (part of a record, or part of one glued to the next), and the lines around it are still good. Refused
    only when no line is a record: empty, or every line broken (then it is not a manifest at all)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: calibration manifest not found") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from exc
    records: list[tuple[int, dict]] = []
    bad: list[tuple[int, str]] = []
    # Decoded line by line: a tear can cut a multi-byte character, which spoils its line, not the file.
    for number, chunk in enumerate(raw.splitlines(), 1):
        try:
            line = chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append((number, f"not UTF-8 text (byte {exc.start})"))
            continue
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append((number, f"not valid JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(item, dict):
            bad.append((number, f"expected a JSON object, got {type(item).__name__}"))
            continue
        records.append((number, item))
    if not records and bad:
        number, why = bad[0]
        if len(bad) == 1:
            raise InputError(f"{path}:{number}: {why}, and it is the manifest's only line")
        raise InputError(
            f"{path}:{number}: {why}; none of its {len(bad)} lines is a JSON object: is it a JSONL manifest?"
        )
    if not records:
        raise InputError(
            f"{path}: the manifest is empty; calibration needs representative samples (see calibration/README.md)"
        )
    return _Parsed(records, bad)


def _warn_skipped(path: Path, parsed: _Parsed) -> int:
    """Name the lines set aside (the first few; the rest are counted) and return how many there were."""
    for number, why in parsed.bad[:_NAMED]:
        log.warning("%s:%d: %s; line skipped", path, number, why)
    if parsed.bad:
        total = len(parsed.bad) + len(parsed.records)
        log.warning(
            "%s: %d of %d lines skipped (not a JSON object), %d records used",
            path,
            len(parsed.bad),
            total,
            len(parsed.records),
        )
    return len(parsed.bad)


def read_text_manifest(path: Path, limit: int | None = None) -> Samples[TextSample]:
    """The first ``limit`` LLM records (all when None); lines that are not JSON objects are skipped and
    counted. A JSON object that is not a record (wrong keys, an empty prompt) is an error naming its line."""
    parsed = _lines(path)
    out: Samples[TextSample] = Samples(skipped=_warn_skipped(path, parsed))
    for number, item in parsed.records:
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


def _with_audio(path: Path, limit: int | None) -> tuple[Path, _Parsed]:
    """The manifest's lines, and where their audio is (synthesised audio for the first ``limit`` made now)."""
    from .synth_audio import materialise

    parsed = _lines(path)
    return materialise(path, parsed.records[: limit or None]), parsed


def read_audio_manifest(path: Path, limit: int | None = None, need_text: bool = False) -> Samples[AudioSample]:
    """The first ``limit`` ASR records (all when None); lines that are not JSON objects are skipped and
    counted, as in ``read_text_manifest``."""
    manifest = path
    path, parsed = _with_audio(path, limit)
    out: Samples[AudioSample] = Samples(skipped=_warn_skipped(manifest, parsed))
    for number, item in parsed.records:
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
    if any(isinstance(item.get("audio"), str) for _, item in _lines(path).records):
        path = _with_audio(path, limit)[0]  # the audio is part of the key: make it before hashing it
    for _, item in _lines(path).records[: limit or None]:
        audio = item.get("audio")
        if isinstance(audio, str):
            file = path.parent / audio
            if file.is_file():
                h.update(hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()


def read_text_corpus(path: Path) -> str:
    """Held-out text for perplexity: a text file as it is (UTF-8), or a JSONL manifest (``.jsonl``) whose
    lines are ``{"text": "..."}`` or ``{"prompt": "..."}``, joined by blank lines. Missing, unreadable,
    not UTF-8 or empty: an error naming the file (and the line, for a manifest)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: text file not found") from None
    except IsADirectoryError:
        raise InputError(f"{path}: a directory, not a text file or JSONL manifest") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the text ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = raw[: exc.start].count(b"\n") + 1
        raise InputError(f"{path}:{at}: not UTF-8 text (byte {exc.start})") from None
    if path.suffix.lower() == ".jsonl":
        parts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            value = item.get("text", item.get("prompt")) if isinstance(item, dict) else None
            if not isinstance(value, str):
                raise InputError(f'{path}:{number}: expected {{"text": "..."}} or {{"prompt": "..."}}')
            if value.strip():
                parts.append(value)
        text = "\n\n".join(parts)
    if not text.strip():
        raise InputError(f"{path}: the text is empty")
    return text
