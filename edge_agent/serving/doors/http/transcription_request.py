"""The form fields of ``POST /v1/audio/transcriptions`` as OpenAI's API names them, checked before any
audio is decoded: each is honoured, or refused with a ``FieldError`` whose ``param`` names the field
(HTTP 400). Nothing a client sends is silently ignored.

- ``response_format``: ``json`` (default), ``text``, ``srt``, ``vtt``, ``verbose_json``;
- ``model``: checked by the ASR ladder (``edge-agent`` or one of its tier names), passed through;
- ``language``: checked by the ASR ladder against the tier's language, passed through;
- ``prompt``: the recognisers take no text prompt, so a non-empty one is refused;
- ``temperature``: decoding is deterministic, so only 0 is accepted;
- ``timestamp_granularities[]``: ``segment`` (what ``verbose_json``, ``srt`` and ``vtt`` give) is
  accepted with those formats; ``word`` is refused (no word times);
- ``stream``: ``false`` only (live transcription is the WebSocket ``/v1/audio/stream``);
- any other field (``include[]``, ``chunking_strategy``, …) is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from ....errors import FieldError

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMED_FORMATS = ("verbose_json", "srt", "vtt")
GRANULARITIES = ("segment", "word")
_GRANULARITY_FIELDS = ("timestamp_granularities[]", "timestamp_granularities")
KNOWN_FIELDS = frozenset(
    {"file", "model", "language", "prompt", "response_format", "temperature", "stream", *_GRANULARITY_FIELDS}
)


class FormFields(Protocol):
    """What is read from a parsed form (aiohttp's ``MultiDictProxy`` has it): repeated fields included."""

    def __iter__(self) -> Iterator[str]: ...
    def getall(self, key: str, default: list) -> list: ...


@dataclass(frozen=True, slots=True)
class TranscriptionOptions:
    """A transcription request's checked fields; ``model`` and ``language`` are ``None`` when not sent."""

    response_format: str = "json"
    model: str | None = None
    language: str | None = None


def parse_options(form: FormFields) -> TranscriptionOptions:
    """The request's options, or an ``FieldError`` naming the first field that cannot be honoured."""
    unknown = sorted({k for k in form if k not in KNOWN_FIELDS})
    if unknown:
        raise FieldError(
            f"unsupported field(s) {', '.join(map(repr, unknown))}: this API takes {', '.join(sorted(KNOWN_FIELDS))}",
            param=unknown[0],
        )
    response_format = _text(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise FieldError(
            f"response_format {response_format!r} is not offered; use one of {', '.join(FORMATS)}",
            param="response_format",
        )
    if _text(form, "prompt"):
        raise FieldError(
            "prompt is not supported: the speech recognisers here take no text prompt; omit it", param="prompt"
        )
    _check_temperature(_text(form, "temperature"))
    _check_stream(_text(form, "stream"))
    _check_granularities(form, response_format)
    return TranscriptionOptions(response_format, _text(form, "model") or None, _text(form, "language") or None)


def _text(form: FormFields, name: str) -> str:
    """The field's one value, stripped ('' when absent); a file or a repeated value is refused."""
    values = form.getall(name, [])
    if not values:
        return ""
    if len(values) > 1:
        raise FieldError(f"{name} was sent {len(values)} times; send it once", param=name)
    if not isinstance(values[0], str):
        raise FieldError(f"{name} must be a text field, not a file", param=name)
    return values[0].strip()


def _check_temperature(raw: str) -> None:
    if not raw:
        return
    try:
        value = float(raw)
    except ValueError:
        raise FieldError(f"temperature must be a number, got {raw!r}", param="temperature") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise FieldError(f"temperature must be between 0 and 1, got {raw}", param="temperature")
    if value != 0.0:
        raise FieldError(
            f"temperature {raw} is not supported: the speech recognisers decode deterministically "
            "(greedy or beam search); send 0 or omit it",
            param="temperature",
        )


def _check_stream(raw: str) -> None:
    if raw.lower() in ("", "false", "0"):
        return
    if raw.lower() in ("true", "1"):
        raise FieldError(
            "stream is not supported on /v1/audio/transcriptions: for live text use the WebSocket "
            "/v1/audio/stream (partial and final events)",
            param="stream",
        )
    raise FieldError(f"stream must be true or false, got {raw!r}", param="stream")


def _check_granularities(form: FormFields, response_format: str) -> None:
    field = next((f for f in _GRANULARITY_FIELDS if form.getall(f, [])), None)
    if field is None:
        return
    values = [v.strip() if isinstance(v, str) else v for v in form.getall(field, [])]
    for v in values:
        if v not in GRANULARITIES:
            raise FieldError(
                f"timestamp_granularities {v!r} is not one of {', '.join(GRANULARITIES)}",
                param="timestamp_granularities",
            )
    if "word" in values:
        raise FieldError(
            "timestamp_granularities 'word' is not available: the recognisers time whole utterances "
            "(segments), not words; ask for 'segment'",
            param="timestamp_granularities",
        )
    if response_format not in TIMED_FORMATS:
        raise FieldError(
            f"timestamp_granularities needs a response_format with timestamps ({', '.join(TIMED_FORMATS)}); "
            f"{response_format!r} has none",
            param="timestamp_granularities",
        )
