"""A transcription rendered in each ``response_format`` of OpenAI's ``/v1/audio/transcriptions``.

Input is what ``TieredSpeech.transcribe_bytes`` returns: ``text``, ``duration`` (seconds of the upload),
``language``, ``segments`` (each ``id``, ``start``, ``end`` in seconds of the upload, ``text``, plus the
agent's own fields) and the serving ``model`` / ``tier``. Output:

- ``json``: ``{"text": ...}``;
- ``text``: the text and a newline, ``text/plain``;
- ``srt``: SubRip cues numbered from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, one per segment;
- ``vtt``: WebVTT, a ``WEBVTT`` header, then ``HH:MM:SS.mmm --> HH:MM:SS.mmm`` cues;
- ``verbose_json``: OpenAI's shape (``task`` ``"transcribe"``, ``language``, ``duration``, ``text``,
  ``segments``) with the agent's ``model`` and ``tier`` added.

Pure functions: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any

TEXT_TYPE = "text/plain"


def timestamp(seconds: float, decimal: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SubRip; ``decimal="."`` for WebVTT), rounded to the millisecond; never negative."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _cue_text(text: str) -> str:
    # A blank line ends a cue in both formats, and "-->" would read as a timing line in WebVTT.
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "\n".join(lines).replace("-->", "->")


def srt(segments: list[dict]) -> str:
    """SubRip: ``n``, ``start --> end``, the text, a blank line, for each segment with text."""
    cues = [s for s in segments if _cue_text(s["text"])]
    return "".join(
        f"{n}\n{timestamp(s['start'])} --> {timestamp(s['end'])}\n{_cue_text(s['text'])}\n\n"
        for n, s in enumerate(cues, 1)
    )


def vtt(segments: list[dict]) -> str:
    """WebVTT: the ``WEBVTT`` header, then ``start --> end`` and the text for each segment with text."""
    cues = [s for s in segments if _cue_text(s["text"])]
    body = "".join(
        f"{timestamp(s['start'], '.')} --> {timestamp(s['end'], '.')}\n{_cue_text(s['text'])}\n\n" for s in cues
    )
    return "WEBVTT\n\n" + body


def verbose_json(result: dict) -> dict[str, Any]:
    """OpenAI's verbose transcription object; the agent's ``model`` and ``tier`` ride along."""
    out: dict[str, Any] = {
        "task": "transcribe",
        "language": result["language"],
        "duration": result["duration"],
        "text": result["text"],
        "segments": result["segments"],
    }
    out.update({k: result[k] for k in ("model", "tier") if k in result})
    return out


def render(result: dict, response_format: str) -> tuple[dict[str, Any] | str, str]:
    """``(body, content type)``: a dict is sent as JSON, a string as ``text/plain``."""
    if response_format == "text":
        return result["text"] + "\n", TEXT_TYPE
    if response_format == "srt":
        return srt(result["segments"]), TEXT_TYPE
    if response_format == "vtt":
        return vtt(result["segments"]), TEXT_TYPE
    if response_format == "verbose_json":
        return verbose_json(result), "application/json"
    if response_format == "json":
        return {"text": result["text"]}, "application/json"
    raise ValueError(f"response_format {response_format!r} is not one of json, text, srt, vtt, verbose_json")
