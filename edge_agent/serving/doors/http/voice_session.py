"""The speech WebSocket's respond option (``GET /v1/audio/stream?respond=true``): the voice turn on the daemon.

The stream's finals are answered by the LLM ladder through a ``VoiceTurn`` (``doors/voice/turn.py``):
its turns may end early (``[audio] early_end``), stable partials are prefilled ahead and a pause's text
gets its whole reply started ahead (``[audio] prefill_ahead``, ``respond_ahead``), and an early reply is
cancelled, never sent, when the speaker goes on. Before any audio the client may send one JSON text
message that sets the reply:

    {"tools": [...OpenAI function tools...], "tool_choice": "required" | "auto", "max_tokens": 160}

(all optional; without tools the reply is words). After each final with text comes one event

    {"kind": "reply", "utterance": 0, "text": "...", "tool_calls": [...] | null, "finish_reason": "tool_calls",
     "endpoint_ms": 200.1, "first_token_ms": 231.5, "complete_ms": 262.0, "cached_tokens": 704,
     "reply_ahead": true}

(times from the end of speech), or ``{"kind": "error", "utterance": 0, "code": "reply_failed", ...}``
when the LLM refused the request. Replies go out in the order of their finals.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ....errors import InputError
from ...asr.events import AsrEvent
from ..host import Mailbox
from ..ladders import LlmLadder, SpeechStream
from ..openai.output import parse_tools, split_tool_call
from ..voice.command_check import command_check
from ..voice.turn import TurnResult, VoiceTurn

log = logging.getLogger(__name__)
MAX_TOKENS = 1024  # a voice reply's bound, whatever the client asks


class VoiceSession:
    """One WebSocket stream's voice turns: ``configure`` (the client's first text message), ``on_event``
    (from the ASR thread, every event as it is), ``run`` (the loop's task sending the replies), then
    ``finish`` (input ended: every final answered) or ``abort`` (the client left: replies cancelled)."""

    def __init__(self, llm: LlmLadder, outbox: Mailbox[dict | None], options: dict[str, Any]) -> None:
        """``outbox``: the stream's events to the client (its loop is this session's); ``options``: the
        ``VoiceTurn`` settings (``voice.turn.turn_options``)."""
        self.llm, self.outbox, self.loop = llm, outbox, outbox.loop
        self._options = dict(options)
        self.turn = self._turn(None, "required", None)
        self.configured = False
        self.stream: SpeechStream | None = None  # the ASR stream, once it is open
        self._finals: Mailbox[AsrEvent | None] = Mailbox(self.loop)
        self._task: asyncio.Task | None = None
        # its own thread for the blocking ``on_final``: a reply may take seconds, and the loop's default
        # executor also takes every stream's audio
        self._replier = ThreadPoolExecutor(1, thread_name_prefix="voice-reply")
        self._open = False  # told the ladder this stream is open

    def _submit(self, chat, params, tags=()):
        # a prefill ahead (one token) is routed as the reply it warms: it fills the cache of the tier that
        # will serve the reply (``TieredLLM.submit``)
        return self.llm.submit(chat, params, tags=tags, route_new_tokens=self.turn.max_new_tokens)

    def _turn(self, tools: list[dict] | None, tool_choice: str, max_tokens: int | None) -> VoiceTurn:
        return VoiceTurn(self._submit, tools, tool_choice=tool_choice, max_new_tokens=max_tokens, **self._options)

    def configure(self, text: str) -> None:
        """The client's reply settings (see the module doc); an ``InputError`` saying what is wrong, whatever
        the text (nesting deeper than the parser's stack and integers longer than Python reads included)."""
        if self.configured:
            raise InputError("the reply settings come once, before any audio")
        try:
            self._configure(text)
        except RecursionError as exc:  # anywhere in reading or checking them: the stream goes on
            raise InputError("reply settings: nested too deeply to read") from exc

    def _configure(self, text: str) -> None:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"reply settings: not JSON (line {exc.lineno}: {exc.msg})") from exc
        except ValueError as exc:  # an integer of more digits than int() converts
            raise InputError(f"reply settings: not readable JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise InputError("reply settings: expected a JSON object")
        unknown = sorted(set(body) - {"tools", "tool_choice", "max_tokens"})
        if unknown:
            raise InputError(f"reply settings: unknown field(s) {unknown}; known: tools, tool_choice, max_tokens")
        tools = parse_tools(body["tools"], "reply settings") if body.get("tools") is not None else None
        choice = body.get("tool_choice", "required")
        if choice not in ("required", "auto"):
            raise InputError(f'reply settings: tool_choice must be "required" or "auto", not {choice!r}')
        limit = body.get("max_tokens")
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_TOKENS
        ):
            raise InputError(f"reply settings: max_tokens must be an integer in 1..{MAX_TOKENS}")
        old, self.turn = self.turn, self._turn(tools, choice, limit)
        old.close()
        if self.stream is not None:  # a whole command for these tools may end a turn early
            self.stream.set_complete(command_check(tools))
            self.stream.set_context(tools)  # the recogniser is told the words these tools expect
        self.configured = True

    def on_event(self, event: AsrEvent) -> None:
        """ASR thread: every event to the turn; a final with text is queued for its reply."""
        self.configured = True  # audio has started: the settings are what they are
        self.turn.on_event(event)
        if event.kind == "final" and event.text.strip():
            self._finals.post(event)

    def start(self) -> None:
        self._task = self.loop.create_task(self._run())
        self._voice(True)

    def _voice(self, opened: bool) -> None:
        """Tell the LLM ladder a voice stream opened or closed (chats then leave a row free for it)."""
        if opened != self._open:
            self._open = opened
            (self.llm.voice_opened if opened else self.llm.voice_closed)()

    async def _run(self) -> None:
        while (event := await self._finals.get()) is not None:
            ends = self.stream.endpoint(event.utterance) if self.stream is not None else None
            speech_end = ends[0] if ends is not None else None
            try:
                result = await self.loop.run_in_executor(self._replier, self.turn.on_final, event, speech_end)
            except Exception as exc:  # a bug in one turn must not end the stream's replies
                log.exception("voice turn failed")
                result = None
                self.outbox.put(_error(event.utterance, str(exc)))
            if result is not None:
                out = reply_event(result, bool(self.turn.tools))
                if out is not None:
                    self.outbox.put(out)

    async def finish(self) -> None:
        """Input ended and every final is out: answer what is queued, then stop."""
        # behind any final the ASR thread queued before the stream said it was finished
        self._finals.post(None)
        if self._task is not None:
            await self._task
        self._voice(False)
        self.turn.close()
        self._replier.shutdown(wait=False)

    async def abort(self) -> None:
        """The client left: what is running or ahead is cancelled, nothing more is sent."""
        self.turn.close()
        self._finals.clear()
        self._finals.put(None)
        if self._task is not None:
            await self._task
        self._voice(False)
        self._replier.shutdown(wait=False)


def reply_event(result: TurnResult, tools: bool) -> dict | None:
    """A delivered turn as the stream's ``reply`` event (a call as the chat route gives it: cut short by
    ``max_tokens``, still ``tool_calls`` with the arguments written, ``finish_reason`` ``length``); a
    refused one as an ``error``; None for a reply cancelled because the speaker went on (its utterance's
    next final gets the reply)."""
    if result.error is not None:
        return _error(result.utterance, result.error)
    if not result.delivered:
        return None
    text, call, complete = split_tool_call(result.reply) if tools else (result.reply, None, False)
    reason = "tool_calls" if complete else ("length" if result.finish_reason == "length" else "stop")

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    return {
        "kind": "reply",
        "utterance": result.utterance,
        "text": text or "",
        "tool_calls": [call] if call else None,
        "finish_reason": reason,
        "endpoint_ms": ms(result.endpoint_ms),
        "first_token_ms": ms(result.turn_first_token_ms),
        "complete_ms": ms(result.turn_complete_ms),
        "cached_tokens": result.cached_tokens,
        "reply_ahead": result.reply_ahead,
    }


def _error(utterance: int, message: str) -> dict:
    return {"kind": "error", "utterance": utterance, "code": "reply_failed", "error": message, "message": message}
