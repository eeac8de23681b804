"""The voice turn: a stream's partial and final transcripts → one LLM reply (or tool call), early.

    turn = VoiceTurn(scheduler.submit, lm.tokenizer, tools)      # one per audio stream
    stream = service.open_stream(on_event=turn.on_event)          # speech_start and partial events
    result = turn.on_final(final_event, speech_end_s)             # blocks until the reply; a TurnResult
    turn.close()

Two things make the turn shorter than "final transcript, then a prefill from zero":

- **Prefill ahead.** Once a partial transcript has not changed for ``stable_ms``, the prompt made of it
  (the same chat template and tools as the final's) is sent with ``max_new_tokens=1`` and the
  ``warmup`` tag (kept out of the SLA windows and metrics, as warm-up requests are): the prefix cache
  then holds its KV, and the final's request prefills only what comes after the common prefix. At most
  one such prefill is in flight and at most ``max_prefills`` go out per utterance; each is counted, and
  those whose text was not the final's are counted as wasted.
- **Early end, safely.** The ASR stream may end an utterance before its full trailing-silence wait
  (``serving/asr/service.py``, ``EarlyEnd``). If the speaker goes on within that wait, the stream
  starts the *same* utterance number again: the early reply is cancelled and never delivered (no
  tool call twice); a reply already delivered by then is a false cut, counted in ``false_cuts``.

Thread use: ``on_event`` / ``on_partial`` / ``on_speech_start`` only record and cancel (they run on
the ASR threads); prompts are tokenized and prefills submitted by ``tick()``, called every ``tick_s``
by a small thread of the turn's own, or by the caller when ``tick_s`` is None (tests, fake clocks).
``on_final`` runs on the caller's thread and waits for the reply.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..metrics.window import WARMUP
from ..models.sampling import SamplingParams
from ..models.tokenizer import Message
from .llm.admission import Limits
from .openai_output import tool_call, with_tools

log = logging.getLogger(__name__)


def turn_limits(settings: Any) -> Limits:
    """The limits of the voice turn's own scheduler (``listen --respond``, ``bench voice``): two rows (the
    final's request is admitted beside a prefill ahead still running, never behind it), no batching wait,
    the prefix cache and jump-forward decoding as ``settings`` configure them."""
    cache = settings.prefix_cache
    return Limits(
        max_batch=2,
        batch_timeout_ms=0,
        prefix_cache_mb=cache.limit_mb,
        prefix_block_tokens=cache.block_tokens,
        jump_forward=settings.batching.jump_forward,
    )


@dataclass(frozen=True)
class TurnResult:
    """One final transcript's reply and where its time went (ms from the end of speech)."""

    stream: int
    utterance: int
    text: str
    reply: str
    call: dict | None  # with tools: {"name", "arguments"}, or None (words, or cut short)
    delivered: bool  # False: cancelled, the speaker went on after an early end
    early_end: bool  # the utterance was ended before the full trailing-silence wait
    endpoint_ms: float | None  # end of speech → end-of-turn decision (None: end of speech unknown)
    turn_first_token_ms: float | None  # end of speech (else the decision) → first token
    turn_complete_ms: float | None  # → the last token (the complete call)
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    prompt_tokens: int
    prefill_ahead: int  # prefills of a partial sent for this utterance
    prefill_wasted: int  # of those, prefills whose text was not the final's

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class VoiceTurn:
    """One stream's voice turns: prefill ahead on stable partials, the final → the LLM, early replies
    cancelled when the utterance continues. ``llm_submit(ids, params, tags=...)`` returns a handle
    (``LLMScheduler.submit``); ``clock`` must be the clock of the ASR events and of the handle's
    token times (``time.monotonic`` for the real ones)."""

    def __init__(
        self,
        llm_submit: Callable[..., Any],
        tokenizer: Any,
        tools: Sequence[dict] | None = None,
        *,
        tool_choice: str = "required",
        max_new_tokens: int | None = None,
        prefill_ahead: bool = True,
        stable_ms: float = 120.0,
        max_prefills: int = 3,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float | None = 0.02,
    ) -> None:
        self.submit, self.tokenizer, self.tools, self.tool_choice = llm_submit, tokenizer, tools, tool_choice
        self.max_new_tokens = max_new_tokens or (160 if tools else 48)
        self.prefill_ahead, self.stable_ms, self.max_prefills, self.clock = (
            prefill_ahead,
            stable_ms,
            max_prefills,
            clock,
        )
        self.grammar = None
        if tools:
            from ..models import grammar

            self.grammar = grammar.tool_call_grammar(tools) if tool_choice == "required" else None
            self.grammar = self.grammar or grammar.tool_or_text_grammar(tools)
        self._lock = threading.Lock()
        self._starts: dict[tuple[int, int], int] = {}  # speech_starts per (stream, utterance)
        self._finals: dict[tuple[int, int], int] = {}  # finals taken per (stream, utterance)
        self._replying: dict[tuple[int, int], Any] = {}  # the reply in flight per utterance
        self._delivered: set[tuple[int, int]] = set()  # early replies delivered (a resumption = false cut)
        self._pending: tuple[tuple[int, int], str, float] | None = None  # latest partial: key, text, since
        self._prefilled: dict[tuple[int, int], list[str]] = {}  # texts prefilled per utterance
        self._prefill: Any = None  # the prefill in flight
        self._prefill_text = ""
        self.false_cuts = 0
        self.cancelled = 0
        self.prefills = 0
        self.prefills_wasted = 0
        self._closed = threading.Event()
        self._ticker: threading.Thread | None = None
        if tick_s is not None and prefill_ahead:
            self._ticker = threading.Thread(target=self._tick_loop, args=(tick_s,), name="voice-turn", daemon=True)
            self._ticker.start()

    # -- events (ASR threads) -----------------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        """An ASR stream's event: ``speech_start`` and ``partial`` are taken here; finals go to ``on_final``."""
        if event.kind == "speech_start":
            self.on_speech_start(event)
        elif event.kind == "partial":
            self.on_partial(event)

    def on_speech_start(self, event: Any) -> None:
        """Speech starts; the same utterance number again means it continues after an early end."""
        key = (event.stream, event.utterance)
        with self._lock:
            self._starts[key] = self._starts.get(key, 0) + 1
            self._pending = None
            if self._starts[key] == 1:
                return
            handle = self._replying.pop(key, None)
            if key in self._delivered:
                self._delivered.discard(key)
                self.false_cuts += 1
                log.info("stream %d utterance %d: speech resumed after its reply was delivered", *key)
        if handle is not None:
            handle.cancel()

    def on_partial(self, event: Any) -> None:
        """A partial transcript: remembered, prefilled by ``tick`` once stable for ``stable_ms``."""
        if not self.prefill_ahead or not event.text.strip():
            return
        with self._lock:
            self._pending = ((event.stream, event.utterance), event.text, self.clock())

    def tick(self) -> bool:
        """Prefill the pending partial if it has been stable long enough; True when one was sent."""
        with self._lock:
            if self._pending is None:
                return False
            key, text, since = self._pending
            done = self._prefilled.setdefault(key, [])
            if (self.clock() - since) * 1e3 < self.stable_ms or self._finals.get(key, 0) >= self._starts.get(key, 1):
                return False
            if (done and done[-1] == text) or len(done) >= self.max_prefills:
                return False
            if self._prefill is not None and not self._prefill.done:
                return False  # one in flight at a time
            done.append(text)
            self.prefills += 1
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        handle = self.submit(self.prompt_ids(text), params, tags=(WARMUP,))
        with self._lock:
            self._prefill, self._prefill_text = handle, text
        return True

    # -- the final (the caller's thread) ---------------------------------------------------------------

    def prompt_ids(self, text: str) -> list[int]:
        """The prompt for ``text``: the user turn with the tools, in the model's chat template."""
        tok = self.tokenizer
        chat = [Message("user", text)]
        if self.tools:
            chat = with_tools(chat, self.tools, self.tool_choice)
        return list(tok.encode_chat(chat) if tok.chat_template else tok.encode(chat[0].content))

    def on_final(self, event: Any, speech_end_s: float | None = None, on_token: Callable[[str], None] | None = None):
        """The reply to a final transcript (blocks until it is complete or cancelled). ``speech_end_s``:
        the end of speech on ``clock`` (``AsrStream.endpoint``); without it times run from the decision."""
        key = (event.stream, event.utterance)
        early = event.metrics is not None and event.metrics.reason == "early"
        decided = event.speech_end_at_s
        origin = speech_end_s if speech_end_s is not None else decided
        endpoint_ms = (decided - speech_end_s) * 1e3 if speech_end_s is not None and decided is not None else None
        with self._lock:
            self._finals[key] = gen = self._finals.get(key, 0) + 1
            superseded = self._starts.get(key, 1) > gen
            sent = list(self._prefilled.get(key, []))
            if self._pending is not None and self._pending[0] == key:
                self._pending = None
            # a prefill of another text would only hold the final's request back (one sequence at a time)
            stale = self._prefill if self._prefill is not None and self._prefill_text != event.text else None
        if stale is not None:
            stale.cancel()
        wasted = sum(1 for t in sent if t != event.text)
        base = dict(stream=event.stream, utterance=event.utterance, text=event.text, early_end=early)
        base.update(endpoint_ms=endpoint_ms, prefill_ahead=len(sent), prefill_wasted=wasted)
        if superseded or not event.text.strip():
            if superseded:
                self._count_cancel()
            return self._empty(base, delivered=False)
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, grammar=self.grammar)
        ids = self.prompt_ids(event.text)
        handle = self.submit(ids, params)
        with self._lock:
            if self._starts.get(key, 1) > gen:  # resumed while we tokenized
                handle.cancel()
            else:
                self._replying[key] = handle
        first = None
        try:
            for token in handle:
                if first is None:
                    first = token.time_s
                if on_token is not None and token.text:
                    on_token(token.text)
            done = handle.result(120.0)
        except Exception as exc:  # a cancelled or failed reply
            log.info("stream %d utterance %d: reply not delivered (%s)", *key, exc)
            done = None
        with self._lock:
            self._replying.pop(key, None)
            delivered = done is not None and not handle.cancelled and self._starts.get(key, 1) <= gen
            if delivered and early:
                self._delivered.add(key)
            self.prefills_wasted += wasted if delivered else 0
        if not delivered or done is None:
            self._count_cancel()
            return self._empty(base, delivered=False)
        times = done.timing.token_times_s
        reply = done.text
        return TurnResult(
            **base,
            reply=reply,
            call=self.call_of(reply) if self.tools else None,
            delivered=True,
            turn_first_token_ms=None if first is None or origin is None else (first - origin) * 1e3,
            turn_complete_ms=None if not times or origin is None else (times[-1] - origin) * 1e3,
            cached_tokens=done.timing.cached_tokens,
            prompt_tokens=len(ids),
        )

    def _count_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    @staticmethod
    def _empty(base: dict, delivered: bool) -> TurnResult:
        return TurnResult(
            **base,
            reply="",
            call=None,
            delivered=delivered,
            turn_first_token_ms=None,
            turn_complete_ms=None,
            cached_tokens=0,
            prompt_tokens=0,
        )

    @staticmethod
    def call_of(reply: str) -> dict | None:
        """The tool call in ``reply`` as {"name", "arguments"} (None: words, or cut short)."""
        call = tool_call(reply)
        if not call:
            return None
        return {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}

    def close(self) -> None:
        """Stop the ticker; a prefill still in flight is cancelled."""
        self._closed.set()
        if self._ticker is not None:
            self._ticker.join(5.0)
        with self._lock:
            prefill, self._prefill = self._prefill, None
        if prefill is not None:
            prefill.cancel()

    def _tick_loop(self, period_s: float) -> None:
        while not self._closed.wait(period_s):
            try:
                self.tick()
            except Exception:  # a refused prefill (queue full, prompt too long) costs only its gain
                log.exception("prefill ahead failed")
