"""The local API's speech routes, on the API's loop (``server.ApiServer`` routes them here):

    POST /v1/audio/transcriptions multipart file → json / text / srt / vtt / verbose_json (OpenAI's shapes),
                                  decoded on the executor; ``whisper-1`` (``ASR_ALIASES``) is the active
                                  tier, said in ``warnings``; an unknown model is a 404 ``model_not_found``
    GET  /v1/audio/stream         WebSocket: binary 16 kHz mono PCM16 in, partial/final JSON out;
                                  ``?respond=true``: each final answered by the LLM (``voice_session``)

A live stream is opened before the WebSocket upgrade, so shedding or draining is a plain 503 with
``Retry-After``; back-pressure, the stall bound and the close codes are described in ``LiveStream``.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSMsgType, web

from ....errors import InputError
from ..host import Mailbox
from ..ladders import LlmLadder, SpeechLadder, SpeechStream
from .errors import error as _error
from .errors import from_exception as _from_exception
from .errors import model_not_found
from .transcript_formats import render
from .transcription_request import parse_options
from .voice_session import VoiceSession

log = logging.getLogger(__name__)
# what ends a stream's input: the text "end", or as JSON keyed like the events ("kind") or as before ("type")
_END = ("end", '{"kind": "end"}', '{"kind":"end"}', '{"type": "end"}', '{"type":"end"}')
# OpenAI's speech model ids that OpenAI clients hard-code: served by the active ASR tier, said in the
# response. An explicit list: any other unknown id stays a 404.
ASR_ALIASES = ("whisper-1",)
STALL_S = 5.0  # a stream's backlog that does not drain within this: the recogniser cannot keep up


async def transcriptions(asr: SpeechLadder | None, request: web.Request) -> web.Response:
    """``POST /v1/audio/transcriptions``: the whole upload through the active ASR tier, answered in the
    ``response_format`` asked for (``transcript_formats``); the form's fields are checked before any
    audio is decoded (``transcription_request``)."""
    if asr is None:
        return _error(503, "no ASR tier is configured", "server_error", "unavailable")
    try:
        form = await request.post()
    except ValueError as exc:
        return _error(400, f"expected multipart/form-data with a 'file' field: {exc}")
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        return _error(400, "missing the 'file' field (multipart/form-data)", param="file")
    try:
        options = parse_options(form)
    except InputError as exc:
        return _error(400, str(exc), param=getattr(exc, "param", None))
    model, warnings = options.model, []
    known = ["edge-agent", *(t.name for t in asr.tiers)]
    if model in ASR_ALIASES and model not in known:
        warnings.append(f"model {model!r} is an alias here: ASR tier {asr.active_tier!r} transcribed this")
        model = None  # the active tier
    elif model is not None and model not in known:
        return model_not_found(model, [*known, *ASR_ALIASES])
    data = upload.file.read()
    transcribe = functools.partial(
        asr.transcribe_bytes, data, upload.filename or "audio", model=model, language=options.language
    )
    try:
        result = await asyncio.get_running_loop().run_in_executor(None, transcribe)
    except InputError as exc:
        return _error(400, str(exc), param=getattr(exc, "param", None))
    except Exception as exc:
        return _from_exception(exc)
    body, content_type = render(result, options.response_format)
    # JSON formats say it in `warnings`, as the generation routes do; text formats have only the header
    said = ", ".join(f'299 edge-agent "{w}"' for w in warnings).encode("ascii", "backslashreplace").decode()
    headers = {"Warning": said} if warnings else None
    if isinstance(body, str):
        return web.Response(text=body, content_type=content_type, charset="utf-8", headers=headers)
    if warnings:
        body["warnings"] = warnings
    return web.json_response(body, headers=headers)


async def audio_stream(
    asr: SpeechLadder | None, request: web.Request, llm: LlmLadder | None = None, voice_options: dict | None = None
) -> web.StreamResponse:
    """``GET /v1/audio/stream``: one live stream on the active ASR tier, events back as JSON; with
    ``?respond=true`` a voice turn on ``llm`` answers each final (``voice_session``). The stream is opened
    before the WebSocket upgrade, so shedding or draining is a plain 503; ``LiveStream`` serves it."""
    if asr is None:
        return _error(503, "no ASR tier is configured", "server_error", "unavailable")
    respond = request.query.get("respond", "").lower()
    if respond not in ("", "0", "false", "1", "true"):
        return _error(400, f"respond must be true or false, not {respond!r}", "invalid_request_error", None, "respond")
    outbox: Mailbox[dict | None] = Mailbox(asyncio.get_running_loop())
    voice = None
    if respond in ("1", "true"):
        if llm is None:
            return _error(503, "respond needs an LLM tier and none is configured", "server_error", "unavailable")
        voice = VoiceSession(llm, outbox, voice_options or {})
    try:  # before the upgrade, so shedding or draining is a plain 503 with Retry-After
        stream = asr.open_stream(outbox.post, voice=voice.on_event) if voice else asr.open_stream(outbox.post)
    except Exception as exc:
        if voice is not None:
            voice.turn.close()
        return _from_exception(exc)
    live = LiveStream(request, outbox, stream, voice)
    await live.upgrade()
    return await live.serve()


class State(enum.Enum):
    """Where a live stream is: reading its client, or how the reading ended."""

    RECEIVING = "receiving"
    ENDED = "ended"  # the client sent "end": its finals (and replies) come, then the close
    OVERLOADED = "overloaded"  # the recogniser could not catch up: an error, then close 1013
    LEFT = "left"  # the connection went (or this handler was cancelled): its work is dropped


class LiveStream:
    """One ``GET /v1/audio/stream`` WebSocket on an open ASR stream (and, with ``?respond=true``, its voice
    session), as a small state machine: ``upgrade``, then ``serve`` reads the client in ``RECEIVING``, each
    message to its handler (audio, text), until a handler or the connection moves it to ``ENDED``,
    ``OVERLOADED`` or ``LEFT``; that state's close step runs, then the events still queued go out and the
    socket closes.

    Back-pressure: while the stream's unprocessed audio is over its bound this handler does not read the
    socket (aiohttp then pauses the transport, and TCP slows the client down). A backlog that does not
    drain within ``STALL_S`` (under the heartbeat's 10 s pong wait) means the server cannot keep up at
    all: an ``overloaded`` error and close 1013 (try again later)."""

    def __init__(
        self, request: web.Request, outbox: Mailbox[dict | None], stream: SpeechStream, voice: VoiceSession | None
    ) -> None:
        self.request, self.outbox, self.stream, self.voice = request, outbox, stream, voice
        self.loop = outbox.loop
        self.ws = web.WebSocketResponse(heartbeat=20)
        self.state = State.RECEIVING
        self.overloaded = ""  # why, in OVERLOADED
        self._on_message: dict[WSMsgType, Callable[[Any], Awaitable[None]]] = {
            WSMsgType.BINARY: self._on_audio,  # any other type (an ERROR) is skipped
            WSMsgType.TEXT: self._on_text,
        }
        self._close_step: dict[State, Callable[[], Awaitable[None]]] = {
            State.ENDED: self._close_ended,
            State.OVERLOADED: self._close_overloaded,
            State.LEFT: self._close_left,
        }

    async def upgrade(self) -> None:
        """The WebSocket handshake. A failed one (not a WebSocket after all, or the client left) keeps
        nothing: the stream and the voice session are dropped, and the failure goes on to aiohttp."""
        sock = self.request.transport.get_extra_info("socket") if self.request.transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a fixed receive buffer (~2 s of PCM16 at 16 kHz) rather than one autotuned up to tcp_rmem's
            # maximum (tens of MB: minutes of audio), so that back-pressure reaches the client
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        try:
            await self.ws.prepare(self.request)
        except BaseException:
            self.stream.abort("the WebSocket upgrade failed")
            if self.voice is not None:
                await self.voice.abort()
            raise
        if self.voice is not None:
            self.voice.stream = self.stream
            self.voice.start()

    async def serve(self) -> web.WebSocketResponse:
        """Read the client until the state leaves ``RECEIVING``, then close (see the class doc)."""
        sender = asyncio.create_task(self._send_events())
        try:
            async for msg in self.ws:
                handler = self._on_message.get(msg.type)
                if handler is not None:
                    await handler(msg.data)
                if self.state is not State.RECEIVING:
                    break
        finally:
            if self.state is State.RECEIVING:  # the client closed, or this task was cancelled
                self.state = State.LEFT
            await self._close_step[self.state]()
            self.outbox.post(None)  # after every event the stream emitted
            await sender
            if self.state is State.OVERLOADED:
                await self.ws.close(code=1013, message=b"overloaded: the recogniser cannot keep up")
            else:
                await self.ws.close()
        return self.ws

    # -- RECEIVING: one handler per message type -----------------------------------------------------

    async def _on_audio(self, pcm: bytes) -> None:
        stream = self.stream
        if self._gone():
            self.state = State.LEFT
            return
        await self.loop.run_in_executor(None, stream.push, pcm)
        if stream.over_backlog and not await self._until(lambda: not stream.over_backlog or self._gone(), STALL_S):
            self.overloaded = (
                f"the recogniser is {stream.backlog_s:.1f} s of audio behind this stream and "
                f"did not catch up within {STALL_S:g} s; retry later or send in real time"
            )
            self.state = State.OVERLOADED

    async def _on_text(self, text: str) -> None:
        if text.strip() in _END:
            self.state = State.ENDED
        elif self.voice is not None and text.lstrip().startswith("{"):
            try:
                self.voice.configure(text)
            except InputError as exc:
                await self.ws.send_json(_stream_error("bad_message", str(exc)))
        else:
            await self.ws.send_json(_stream_error("bad_message", 'send binary PCM16 frames, then "end"'))

    # -- the close step of each end state -------------------------------------------------------------

    async def _close_ended(self) -> None:
        """The finals, within the stream's close timeout (past it, errors for what is open); then each
        final's reply."""
        stream = self.stream
        stream.end()
        await self._until(lambda: stream.finished, stream.close_timeout_s)
        stream.close(0)
        if self.voice is not None:
            await self.voice.finish()

    async def _close_overloaded(self) -> None:
        self.stream.abort(self.overloaded, "overloaded")
        log.warning("ASR stream closed: %s", self.overloaded)
        # posted like the stream's own events, so it comes after their utterance errors
        self.outbox.post(_stream_error("overloaded", self.overloaded))
        if self.voice is not None:
            await self.voice.abort()

    async def _close_left(self) -> None:
        """The client went away: its work is dropped rather than finished for nobody."""
        self.stream.abort("the client closed the connection")
        if self.voice is not None:
            await self.voice.abort()

    # -- helpers ---------------------------------------------------------------------------------------

    async def _send_events(self) -> None:
        """The stream's events (and the voice session's replies) to the client, until ``None``."""
        while (event := await self.outbox.get()) is not None:
            if self.ws.closed:
                continue  # the client left: its remaining events have nobody to go to
            try:
                await self.ws.send_json(event)
            except ConnectionError:
                continue

    def _gone(self) -> bool:
        """The connection is closing: audio still buffered from it has nobody to answer."""
        return self.request.transport is None or self.request.transport.is_closing()

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self.loop.time() + timeout_s
        while not done():
            if self.loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def _stream_error(code: str, message: str) -> dict:
    """An error about the whole stream (not one utterance), keyed like every other event: ``kind``
    ``error``, its ``code``, and the text as both ``message`` and ``error`` (an utterance's field)."""
    return {"kind": "error", "code": code, "message": message, "error": message}
