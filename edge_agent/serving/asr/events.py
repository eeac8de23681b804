"""What an ASR stream emits (``AsrEvent``) and the per-utterance figures a final carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class UtteranceMetrics:
    """One utterance's latency and cost, sent with its ``final`` event."""

    first_partial_ms: float | None  # None: no partial before the final (a very short utterance)
    final_ms: float
    rtf: float
    audio_s: float
    compute_ms: float
    reason: str  # why it ended: silence | max_length | end_of_stream


@dataclass(frozen=True, slots=True)
class AsrEvent:
    """What a stream emits: speech start, partial and final text, or an error."""

    kind: Literal["speech_start", "partial", "final", "error"]
    stream: int
    utterance: int
    text: str = ""
    stable_text: str = ""
    audio_s: float = 0.0  # stream time the event refers to (onset; end of the audio a partial covers)
    at_s: float = 0.0  # clock time it was emitted
    metrics: UtteranceMetrics | None = None
    speech_end_at_s: float | None = None  # final only: clock time of the end-of-speech decision
    error: str | None = None
    code: str | None = None  # error only: overloaded | timeout | cancelled | failed
    # partial only: the speaker has paused and this text covers all the speech so far (what the final
    # says if the utterance ends here); asked for with ``open_stream(pause_ms=...)``
    paused: bool = False
