"""The voice turn: a stream's partial and final transcripts → one LLM reply (or tool call), early.

    turn = VoiceTurn(chat_submit(scheduler, lm.tokenizer), tools)  # one per audio stream
    stream = service.open_stream(on_event=turn.on_event)          # speech_start and partial events
    result = turn.on_final(final_event, speech_end_s)             # blocks until the reply; a TurnResult
    turn.close()

Three things make the turn shorter than "final transcript, then a prefill from zero":

- **Prefill ahead.** Once a partial transcript has not changed for ``stable_ms``, the prompt made of it
  (the same chat template and tools as the final's) is sent with ``max_new_tokens=1`` and the
  ``warmup`` tag (kept out of the SLA windows and metrics, as warm-up requests are): the prefix cache
  then holds its KV, and the final's request prefills only what comes after the common prefix. At most
  one such prefill is in flight and at most ``max_prefills`` go out per utterance; each is counted, and
  those whose text was not the final's are counted as wasted.
- **Reply ahead.** When the speaker pauses, the stream brings its partial up to the end of the speech
  and sends it marked ``paused`` (``open_stream(pause_ms=...)``): its whole reply is started at once,
  greedy and constrained like the final's, and held. If the final's text is the same, that reply is
  the final's (the same prompt and parameters give the same tokens) and reaches the caller as soon as
  the final does; if the final reads otherwise (the speaker went on), a later pause starts another, or
  the speech resumes after an early end, it is cancelled and counted as wasted.
- **Early end, safely.** The ASR stream may end an utterance before its full trailing-silence wait
  (``serving/asr/service.py``, ``EarlyEnd``). If the speaker goes on within that wait, the stream
  starts the *same* utterance number again: the early reply is cancelled and never delivered (no
  tool call twice); a reply already delivered by then is a false cut, counted in ``false_cuts``. After
  a false cut, the whole utterance's final gets its reply held until complete: when it makes the same tool
  call as the one delivered, it is not delivered again (``TurnResult.repeated``, counted in ``repeats``);
  another call (the speaker corrected the command) is delivered.

Thread use: ``on_event`` / ``on_partial`` / ``on_speech_start`` only record and cancel (they run on
the ASR threads); prompts are tokenized and requests sent ahead by ``tick()``, called every ``tick_s``
(at once after a pause's partial) by a small thread of the turn's own, or by the caller when ``tick_s``
is None (tests, fake clocks).
``on_final`` runs on the caller's thread and waits for the reply.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ....errors import Overloaded
from ....metrics.window import WARMUP
from ....models.sampling import SamplingParams
from ....models.tokenizer import Message
from ...llm.admission import INTERACTIVE, Limits
from ..openai.output import tool_call, with_tools

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
    reply_ahead: bool  # the reply was the one started ahead on a pause, on the same text
    early_end: bool  # the utterance was ended before the full trailing-silence wait
    endpoint_ms: float | None  # end of speech → end-of-turn decision (None: end of speech unknown)
    turn_first_token_ms: float | None  # end of speech (else the decision) → first token
    turn_complete_ms: float | None  # → the last token (the complete call)
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    prompt_tokens: int
    prefill_ahead: int  # prefills of a partial sent for this utterance
    prefill_wasted: int  # of those, prefills whose text was not the final's
    error: str | None = None  # why there is no reply, when the LLM refused the request
    finish_reason: str | None = None  # the reply's: stop, length (cut short by its token budget), ...
    repeated: bool = False  # the same call as one delivered before the speaker went on: not delivered again

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def turn_options(audio: Any) -> dict[str, Any]:
    """``VoiceTurn``'s settings from the ``[audio]`` section: prefill ahead, reply ahead, stability wait."""
    return dict(
        prefill_ahead=audio.prefill_ahead, respond_ahead=audio.respond_ahead, stable_ms=float(audio.prefill_stable_ms)
    )


def turn_pause_ms(audio: Any, options: dict[str, Any] | None = None) -> int | None:
    """The pause after which a voice turn's stream sends its text ahead (``open_stream(pause_ms=...)``):
    ``[audio] pause_ms`` when ``options`` (default ``turn_options(audio)``) start replies ahead, else None."""
    o = options if options is not None else turn_options(audio)
    return audio.pause_ms if o["prefill_ahead"] and o["respond_ahead"] else None


def chat_submit(scheduler: Any, tokenizer: Any) -> Callable[..., Any]:
    """``VoiceTurn``'s submit on one scheduler (``LLMScheduler``): the chat in ``tokenizer``'s template
    (the bare user text for a model without one)."""

    def submit(chat: list[Message], params: SamplingParams, tags: Sequence[str] = ()) -> Any:
        ids = tokenizer.encode_chat(chat) if tokenizer.chat_template else tokenizer.encode(chat[-1].content)
        return scheduler.submit(list(ids), params, tags=tags)

    return submit


def spoken_command(text: str) -> str:
    """A recogniser's sentence as a spoken command is written: lower case, no closing punctuation, ``%`` as
    "percent" (Whisper writes "Turn the bathroom lights down to 20%."; the home-commands adapter reads
    "turn the bathroom lights down to 20 percent": on the natural-voice home commands heard by Whisper base
    25 of 31 calls right against 24, docs/asr.md)."""
    out = " ".join(text.replace("%", " percent").split()).lower()
    return out.rstrip(".!?,;: ").strip()


class VoiceTurn:
    """One stream's voice turns: prefill ahead on stable partials, the reply ahead on a pause, the final →
    the LLM, early replies cancelled when the utterance continues. ``llm_submit(chat, params, tags=...)``
    returns a handle (``chat_submit`` on a scheduler, or the tier ladder's ``TieredLLM.submit``);
    ``clock`` must be the clock of the ASR events and of the handle's token times (``time.monotonic``
    for the real ones)."""

    def __init__(
        self,
        llm_submit: Callable[..., Any],
        tools: Sequence[dict] | None = None,
        *,
        tool_choice: str = "required",
        max_new_tokens: int | None = None,
        prefill_ahead: bool = True,
        respond_ahead: bool = True,
        stable_ms: float = 120.0,
        max_prefills: int = 3,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float | None = 0.02,
    ) -> None:
        self.submit, self.tools, self.tool_choice = llm_submit, tools, tool_choice
        self.max_new_tokens = max_new_tokens or (160 if tools else 48)
        self.prefill_ahead, self.respond_ahead = prefill_ahead, respond_ahead and prefill_ahead
        self.stable_ms, self.max_prefills, self.clock = stable_ms, max_prefills, clock
        self.grammar = None
        if tools:
            from ....models import grammar

            self.grammar = grammar.tool_call_grammar(tools) if tool_choice == "required" else None
            self.grammar = self.grammar or grammar.tool_or_text_grammar(tools)
        self._lock = threading.Lock()
        # held by ``tick`` from its decision until what it sent is recorded, and taken by ``on_final`` first:
        # a final never misses the reply a pause's partial is starting on the same words (nor starts a second)
        self._sending = threading.Lock()
        self._starts: dict[tuple[int, int], int] = {}  # speech_starts per (stream, utterance)
        self._finals: dict[tuple[int, int], int] = {}  # finals taken per (stream, utterance)
        self._replying: dict[tuple[int, int], Any] = {}  # the reply in flight per utterance
        self._delivered: dict[tuple[int, int], dict | None] = {}  # early replies delivered: their calls
        self._cut_calls: dict[tuple[int, int], dict] = {}  # the calls of replies delivered before a false cut
        # the latest partial not yet sent ahead: key, text, since, whether it came with a pause
        self._pending: tuple[tuple[int, int], str, float, bool] | None = None
        self._prefilled: dict[tuple[int, int], list[str]] = {}  # texts sent ahead per utterance
        self._prefill: _Ahead | None = None  # the latest prefill sent ahead
        self._replies: dict[tuple[int, int], _Ahead] = {}  # per utterance: its latest reply ahead, not yet taken
        self.false_cuts = 0
        self.repeats = 0  # replies after a false cut that made the delivered call again (not delivered)
        self.cancelled = 0
        self.prefills = 0
        self.prefills_wasted = 0
        self.replies_ahead = 0  # whole replies started on a pause
        self.replies_ahead_used = 0  # of those, replies that were the final's
        self._closed = threading.Event()
        self._wake = threading.Event()  # a pause's partial: tick now
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
            stale = [a.handle for a in self._take_ahead(key) if a is not None]
            if key in self._delivered:
                call = self._delivered.pop(key)
                if call is not None:
                    self._cut_calls[key] = call
                self.false_cuts += 1
                log.info("stream %d utterance %d: speech resumed after its reply was delivered", *key)
        for h in (handle, *stale):
            if h is not None:
                h.cancel()

    def on_partial(self, event: Any) -> None:
        """A partial transcript: remembered, prefilled by ``tick`` once stable for ``stable_ms``; one that
        comes with a pause (``paused``) has its whole reply started ahead at once. (A streaming partial
        after a pause may still lag the pause's text by a few letters: only the final, a later pause or
        resumed speech after an early end retire a reply ahead.)"""
        if not self.prefill_ahead or not event.text.strip():
            return
        paused = bool(getattr(event, "paused", False)) and self.respond_ahead
        key = (event.stream, event.utterance)
        with self._lock:
            waiting = self._pending
            if not paused and waiting is not None and waiting[0] == key and waiting[3]:
                return  # a pause's text waits for ``tick``: a lagging streaming partial must not replace it
            self._pending = (key, event.text, self.clock(), paused)
        if paused:
            self._wake.set()

    def tick(self) -> bool:
        """Send the pending partial ahead if it is due: a pause's at once (its whole reply), another once
        stable for ``stable_ms`` (its prefill). True when one was sent."""
        with self._sending:
            return self._tick()

    def _tick(self) -> bool:
        with self._lock:
            if self._pending is None:
                return False
            key, text, since, full = self._pending
            done = self._prefilled.setdefault(key, [])
            if self._finals.get(key, 0) >= self._starts.get(key, 1):
                return False
            reply = self._replies.get(key)
            if full:
                self._pending = None
                if reply is not None and reply.said == self.said(text):
                    return False
            else:
                if (self.clock() - since) * 1e3 < self.stable_ms:
                    return False
                if (done and done[-1] == text) or len(done) >= self.max_prefills or reply is not None:
                    return False  # a reply ahead has prefilled this utterance already
                if self._prefill is not None and not self._prefill.handle.done:
                    return False  # one in flight at a time
            done.append(text)
            self.prefills += 1
            self.replies_ahead += full
            replaced = reply if full else None
        if replaced is not None:
            replaced.handle.cancel()  # an earlier pause's: the speaker went on
        if full:
            params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, grammar=self.grammar)
        else:
            params = SamplingParams(max_new_tokens=1, temperature=0.0)
        handle = self.submit(self.chat(text), params, tags=(WARMUP, INTERACTIVE))
        ahead = _Ahead(key, text, self.said(text), full, handle)
        with self._lock:
            # the final may have been taken (or the turn closed) while this was submitted: nobody would
            # take the request then
            late = self._closed.is_set() or self._finals.get(key, 0) >= self._starts.get(key, 1)
            if not late and full:
                self._replies[key] = ahead
            elif not late:
                self._prefill = ahead
        if late:
            handle.cancel()
        return True

    def _take_ahead(self, key: tuple[int, int]) -> tuple[_Ahead | None, _Ahead | None]:
        """Under the lock: the prefill and the reply sent ahead for ``key``, no longer this turn's."""
        prefill = self._prefill if self._prefill is not None and self._prefill.key == key else None
        if prefill is not None:
            self._prefill = None
        return prefill, self._replies.pop(key, None)

    # -- the final (the caller's thread) ---------------------------------------------------------------

    def said(self, text: str) -> str:
        """What of ``text`` the prompt carries: with tools the words as a command is written (two transcripts
        that differ only in case or closing punctuation get the same reply), else ``text``."""
        return spoken_command(text) if self.tools else text

    def chat(self, text: str) -> list[Message]:
        """The prompt for ``text``: the user turn, with the tools described at its start. With tools the
        words are put as a spoken command is written (``spoken_command``)."""
        if not self.tools:
            return [Message("user", text)]
        return with_tools([Message("user", self.said(text))], self.tools, self.tool_choice)

    def on_final(self, event: Any, speech_end_s: float | None = None, on_token: Callable[[str], None] | None = None):
        """The reply to a final transcript (blocks until it is complete or cancelled). ``speech_end_s``:
        the end of speech on ``clock`` (``AsrStream.endpoint``); without it times run from the decision.
        A reply started ahead on the same text is this reply; it reaches the caller no earlier than the
        final does (``event.at_s``).

        In steps, each on the final's record (``_Final``): take the final (what was sent ahead for its
        utterance is adopted or cancelled), start its reply (or answer at once: superseded, no words, the
        turn closed, refused), follow the reply's tokens, settle it (delivered, cancelled by resumed
        speech, or the repeat of a call a false cut delivered), and the ``TurnResult``."""
        with self._sending:  # a reply a pause's partial is starting is recorded first (``tick``)
            final = self._take_final(event, speech_end_s)
        answered = self._start_reply(final)
        if answered is not None:
            return answered
        self._follow(final, on_token)
        self._settle(final)
        return self._result(final, on_token)

    def _take_final(self, event: Any, speech_end_s: float | None) -> _Final:
        """Count the final; adopt the reply started ahead on its text, cancel what was sent ahead for
        another text."""
        key = (event.stream, event.utterance)
        early = event.metrics is not None and event.metrics.reason == "early"
        decided = event.speech_end_at_s
        origin = speech_end_s if speech_end_s is not None else decided
        endpoint_ms = (decided - speech_end_s) * 1e3 if speech_end_s is not None and decided is not None else None
        with self._lock:
            self._forget_before(key)
            self._finals[key] = gen = self._finals.get(key, 0) + 1
            superseded = self._starts.get(key, 1) > gen
            sent = list(self._prefilled.get(key, []))
            if self._pending is not None and self._pending[0] == key:
                self._pending = None
            prefill, reply = self._take_ahead(key)
            cut_call = self._cut_calls.get(key)  # the call a false cut delivered: not to be made twice
        said = self.said(event.text)
        adopted = reply if reply is not None and reply.answers(said) else None
        for ahead in (prefill, reply):
            if ahead is not None and ahead is not adopted and ahead.said != said:
                ahead.handle.cancel()  # another text's request would only hold the final's back
        wasted = sum(1 for t in sent if self.said(t) != said)
        base = dict(stream=event.stream, utterance=event.utterance, text=event.text, early_end=early)
        base.update(endpoint_ms=endpoint_ms, prefill_ahead=len(sent), prefill_wasted=wasted)
        return _Final(event, key, gen, early, superseded, origin, base, wasted, adopted, cut_call)

    def _start_reply(self, final: _Final) -> TurnResult | None:
        """The final's reply in flight (``final.handle``): the one started ahead, or a request sent now.
        A ``TurnResult`` instead when there is none to wait for."""
        event, key = final.event, final.key
        if final.superseded or not event.text.strip():
            if final.superseded:
                self._count_cancel()
            if final.adopted is not None:
                final.adopted.handle.cancel()
            return self._empty(final.base, delivered=False)
        if final.adopted is not None:
            handle = final.adopted.handle
        elif self._closed.is_set():
            return self._empty(final.base, delivered=False, error="the voice turn is closed")
        else:
            params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, grammar=self.grammar)
            try:
                handle = self.submit(self.chat(event.text), params, tags=(INTERACTIVE,))
            except Exception as exc:  # refused (overloaded, shutting down, too long): no reply, counted
                log.warning("stream %d utterance %d: no reply (%s)", *key, exc)
                self._count_cancel()
                return self._empty(final.base, delivered=False, error=str(exc))
        with self._lock:
            if self._starts.get(key, 1) > final.gen:  # resumed while we tokenized
                handle.cancel()
            else:
                self._replying[key] = handle
        final.handle = handle
        return None

    def _follow(self, final: _Final, on_token: Callable[[str], None] | None) -> None:
        """Wait for the reply's tokens, handing each to ``on_token`` as it comes; after a false cut they are
        held until the reply is known not to repeat the call delivered (``final.held``)."""
        handle = final.handle
        final.held = [] if final.cut_call is not None else None
        try:
            for token in handle:
                if final.first_s is None:
                    final.first_s = token.time_s
                if final.held is not None:
                    final.held.append(token.text)
                elif on_token is not None and token.text:
                    on_token(token.text)
            final.done = handle.result(120.0)
        except Exception as exc:  # a cancelled or failed reply
            log.info("stream %d utterance %d: reply not delivered (%s)", *final.key, exc)
            final.done = None

    def _settle(self, final: _Final) -> None:
        """Whether the reply is delivered: complete, not cancelled, the utterance not resumed since, and
        not the same call as one a false cut delivered (``repeated``); the counters follow."""
        done, key = final.done, final.key
        final.call = self.call_of(done.text) if done is not None and self.tools else None
        with self._lock:
            self._replying.pop(key, None)
            delivered = done is not None and not final.handle.cancelled and self._starts.get(key, 1) <= final.gen
            final.repeated = delivered and final.cut_call is not None and final.call == final.cut_call
            if final.repeated:
                self.repeats += 1
                delivered = False
            elif delivered:
                self._cut_calls.pop(key, None)  # this call is the utterance's latest delivered one now
                if final.early:
                    self._delivered[key] = final.call
            self.prefills_wasted += final.wasted if delivered else 0
            self.replies_ahead_used += delivered and final.adopted is not None
        final.delivered = delivered

    def _result(self, final: _Final, on_token: Callable[[str], None] | None) -> TurnResult:
        """The settled reply as a ``TurnResult``, times from the end of speech (a reply ahead counted from
        no earlier than the final)."""
        done, base = final.done, final.base
        if final.repeated:
            log.info("stream %d utterance %d: the same call as before the speaker went on, not repeated", *final.key)
            return replace(self._empty(base, delivered=False), reply=done.text, call=final.call, repeated=True)
        if not final.delivered or done is None:
            self._count_cancel()
            return self._empty(base, delivered=False)
        for text in final.held or ():
            if on_token is not None and text:
                on_token(text)
        times = done.timing.token_times_s
        floor = final.event.at_s if final.adopted is not None else float("-inf")  # a reply ahead waits for the final
        origin = final.origin

        def since_origin(t: float | None) -> float | None:
            return None if t is None or origin is None else (max(t, floor) - origin) * 1e3

        return TurnResult(
            **base,
            reply=done.text,
            call=final.call,
            delivered=True,
            reply_ahead=final.adopted is not None,
            turn_first_token_ms=since_origin(final.first_s),
            turn_complete_ms=since_origin(times[-1] if times else None),
            cached_tokens=done.timing.cached_tokens,
            prompt_tokens=done.timing.tokens_in,
            finish_reason=done.finish_reason,
        )

    def _forget_before(self, key: tuple[int, int], keep: int = 16) -> None:
        """Under the lock: drop what is kept per utterance for the stream's utterances ``keep`` or more
        before ``key``'s (only the latest can still resume), so a long-lived stream holds a bounded amount."""
        stream, utterance = key
        for kept in (self._starts, self._finals, self._prefilled, self._delivered, self._cut_calls):
            for old in [k for k in kept if k[0] == stream and k[1] <= utterance - keep]:
                del kept[old]

    def _count_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    @staticmethod
    def _empty(base: dict, delivered: bool, error: str | None = None) -> TurnResult:
        return TurnResult(
            error=error,
            **base,
            reply="",
            call=None,
            delivered=delivered,
            reply_ahead=False,
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
        """Stop the ticker; every request still in flight (ahead, or a final's reply) is cancelled, and
        finals taken from now on get no reply."""
        self._closed.set()
        self._wake.set()
        if self._ticker is not None:
            self._ticker.join(5.0)
        with self._lock:
            ahead = [a.handle for a in (self._prefill, *self._replies.values()) if a is not None]
            self._prefill, self._replies = None, {}
            replying = list(self._replying.values())
        for handle in (*ahead, *replying):
            handle.cancel()

    def _tick_loop(self, period_s: float) -> None:
        while not self._closed.is_set():
            self._wake.wait(period_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.tick()
            except Overloaded as exc:  # no free row for a request ahead: the final goes without it
                log.debug("nothing sent ahead: %s", exc)
            except Exception:  # a refused request ahead (queue full, prompt too long) costs only its gain
                log.exception("sending ahead failed")


@dataclass
class _Ahead:
    """A request sent ahead of the final: its utterance and text, whether it is the whole reply (a pause's)
    or a prefill, and its handle."""

    key: tuple[int, int]
    text: str
    said: str  # what of it the prompt carries (``VoiceTurn.said``)
    full: bool
    handle: Any

    def answers(self, said: str) -> bool:
        """Whether it is the reply to a final whose prompt carries ``said``: a whole reply on the same words,
        not cancelled and not failed."""
        h = self.handle
        return self.full and self.said == said and not h.cancelled and not (h.done and h.error is not None)


@dataclass
class _Final:
    """One final being answered (``VoiceTurn.on_final``): what was taken with it, then its reply's progress."""

    event: Any
    key: tuple[int, int]
    gen: int  # which final of its utterance (more than one: the speech resumed after an early end)
    early: bool  # the utterance was ended early
    superseded: bool  # the speech resumed before this final was taken: no reply
    origin: float | None  # where its times run from: the end of speech, else the end-of-turn decision
    base: dict  # the TurnResult fields known from the start
    wasted: int  # prefills sent ahead for another text
    adopted: _Ahead | None  # the reply started ahead on its text, now its reply
    cut_call: dict | None  # the call a false cut delivered for this utterance
    handle: Any = None  # the reply in flight
    first_s: float | None = None  # its first token's time
    held: list[str] | None = None  # its tokens held back (after a false cut)
    done: Any = None  # its completion (None: cancelled or failed)
    call: dict | None = None
    delivered: bool = False
    repeated: bool = False
