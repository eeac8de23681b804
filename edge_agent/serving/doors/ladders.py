"""What a front door reads from and asks of the two ladders, as protocols.

A door takes these, never the ladders' classes: ``LlmLadder`` (``serving/llm/tiers.py``, ``TieredLLM``,
implements it) and ``SpeechLadder`` (``serving/asr/tiers.py``, ``TieredSpeech``), whose live streams are
``SpeechStream``s (``PcmStream``). Each lists only what some door uses; a new door that needs more adds it
here, where both ladders are checked against it (mypy, at the daemon that hands the ladders over).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ...models.recognizer import Recognizer
from ...models.sampling import SamplingParams
from ...models.tokenizer import Message
from ..asr.events import AsrEvent
from ..llm.handle import RequestHandle


class Named(Protocol):
    """A tier, as a door names it."""

    @property
    def name(self) -> str: ...


class LlmLadder(Protocol):
    """The LLM ladder: its tiers and what is serving (``/v1/models``, ``/health``, Wyoming's ``info``), and
    ``submit``, which admits one request on the active tier (or refuses it: ``Overloaded``,
    ``Unavailable``, ``InputError``). A voice stream says when it opens and closes (chats then leave a
    row free for it)."""

    @property
    def tiers(self) -> Sequence[Named]: ...
    @property
    def active(self) -> int: ...
    @property
    def active_tier(self) -> str | None: ...
    @property
    def model_name(self) -> str: ...
    @property
    def load(self) -> tuple[int, int]: ...  # (waiting, running) on the active tier
    @property
    def shedding(self) -> bool: ...
    @property
    def switching(self) -> bool: ...

    def submit(
        self,
        prompt: str | Sequence[Message],
        params: SamplingParams = ...,
        *,
        raw: bool = ...,
        tags: Sequence[str] = ...,
        route_new_tokens: int | None = ...,
        budget_ms: float | None = ...,
    ) -> RequestHandle: ...

    def voice_opened(self) -> None: ...
    def voice_closed(self) -> None: ...


class SpeechStream(Protocol):
    """One live stream on the speech ladder: PCM16 in (``push``), events out through the ``on_event`` it was
    opened with. Back-pressure is the door's: while ``over_backlog``, it stops reading its client."""

    close_timeout_s: float

    @property
    def backlog_s(self) -> float: ...
    @property
    def over_backlog(self) -> bool: ...
    @property
    def finished(self) -> bool: ...  # input ended and every utterance has its final or error

    def push(self, pcm16: bytes) -> None: ...
    def end(self) -> None: ...
    def close(self, timeout_s: float | None = None) -> None: ...
    def abort(self, reason: str, code: str = "cancelled") -> None: ...
    # a voice turn's stream: the end of an utterance's speech, its check of a whole command, its tools' words
    def endpoint(self, utterance: int) -> tuple[float, float] | None: ...
    def set_complete(self, complete: Callable[[str], bool | None] | None) -> None: ...
    def set_context(self, tools: Sequence[dict] | None) -> None: ...


class SpeechLadder(Protocol):
    """The speech ladder: whole uploads (``transcribe_bytes``), live streams (``open_stream``; ``voice``: a
    voice turn's, each event also handed over as it is), and what is serving (``/v1/models``, ``/health``,
    Wyoming's ``info``; ``active_engine``: the recogniser a stream is fed, its rate and language)."""

    def transcribe_bytes(
        self, data: bytes, filename: str, *, model: str | None = None, language: str | None = None
    ) -> dict: ...
    def open_stream(
        self, on_event: Callable[[dict], None], voice: Callable[[AsrEvent], None] | None = None
    ) -> SpeechStream: ...

    @property
    def tiers(self) -> Sequence[Named]: ...
    @property
    def active_tier(self) -> str | None: ...
    @property
    def active_engine(self) -> Recognizer | None: ...
    @property
    def model(self) -> str: ...
    @property
    def open_streams(self) -> dict[str, int]: ...
    @property
    def shedding(self) -> bool: ...
    @property
    def switching(self) -> bool: ...
