"""``[asr]``: what the speech recogniser is told to expect (Whisper's initial prompt, docs/asr.md)."""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import Section


class AsrConfig(Section):
    """``[asr]``: words every utterance's context carries, ahead of a voice turn's tools' words."""

    prompt_words: list[str] = Field(
        default_factory=list,
        description="words to expect (names, rooms, devices): given to Whisper as its initial prompt for every "
        "stream, also those that send no tools (a Wyoming client); a voice turn adds its tools' words after them",
    )
    tool_context: bool = Field(
        True, description="a voice turn's tools (names, enum values, descriptions) become the recogniser's context"
    )
    final_padding_s: float = Field(
        6.0,
        ge=0.0,
        le=30.0,
        description="Whisper: a final encodes its audio and this much padding, not 30 s (0: the 30 s pass); "
        "WER on the natural-voice set 5.99 % at 30 s, 5.68 % at 6 s (docs/asr.md)",
    )

    @field_validator("prompt_words")
    @classmethod
    def _words(cls, words: list[str]) -> list[str]:
        out = [" ".join(w.split()) for w in words]
        bad = [w for w in out if not w or len(w) > 200]
        if bad:
            raise ValueError(f"prompt_words: each word 1-200 characters (got {bad[0]!r})")
        if len(out) > 1000:
            raise ValueError(f"prompt_words: at most 1000 entries (got {len(out)}); the recogniser keeps ~220 tokens")
        return out

    def prompt_text(self) -> str:
        return ", ".join(self.prompt_words)
