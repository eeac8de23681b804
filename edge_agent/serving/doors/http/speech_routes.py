"""The local API's speech routes, on the API's loop (``server.ApiServer`` routes them here):

    POST /v1/audio/transcriptions multipart file → json / text / srt / vtt / verbose_json (OpenAI's shapes),
                                  decoded on the executor; ``whisper-1`` (``ASR_ALIASES``) is the active
                                  tier, said in ``warnings``; an unknown model is a 404 ``model_not_found``
    GET  /v1/audio/stream         WebSocket: binary 16 kHz mono PCM16 in, partial/final JSON out;
                                  ``?respond=true``: each final answered by the LLM (``voice_session``)

A live stream is opened before the WebSocket upgrade, so shedding or draining is a plain 503 with
``Retry-After``; back-pressure, the stall bound and the close codes are described in ``audio_stream``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable

from aiohttp import WSMsgType, web

from ....errors import InputError
from ..host import Mailbox
from ..ladders import LlmLadder, SpeechLadder
from .errors import error as _error
from .errors import from_exception as _from_exception
from .errors import model_not_found
from .transcript_formats import render
from .transcription_request import parse_options

log = logging.getLogger(__name__)
# what ends a stream's input: the text "end", or as JSON keyed like the events ("kind") or as before ("type")
_END = ("end", '{"kind": "end"}', '{"kind":"end"}', '{"type": "end"}', '{"type":"end"}')
# OpenAI's speech model ids that OpenAI clients hard-code: served by the active ASR tier, said in the
# response. An explicit list: any other unknown id stays a 404.
ASR_ALIASES = ("whisper-1",)


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
    ``?respond=true`` a voice turn on ``llm`` answers each final (``voice_session``)."""
    if asr is None:
        return _error(503, "no ASR tier is configured", "server_error", "unavailable")
    respond = request.query.get("respond", "").lower()
    if respond not in ("", "0", "false", "1", "true"):
        return _error(400, f"respond must be true or false, not {respond!r}", "invalid_request_error", None, "respond")
    loop = asyncio.get_running_loop()
    outbox: Mailbox[dict | None] = Mailbox(loop)
    voice = None
    if respond in ("1", "true"):
        if llm is None:
            return _error(503, "respond needs an LLM tier and none is configured", "server_error", "unavailable")
        from .voice_session import VoiceSession

        voice = VoiceSession(llm, outbox, voice_options or {})
    try:  # before the upgrade, so shedding or draining is a plain 503 with Retry-After
        stream = asr.open_stream(outbox.post, voice=voice.on_event) if voice else asr.open_stream(outbox.post)
    except Exception as exc:
        if voice is not None:
            voice.turn.close()
        return _from_exception(exc)
    ws = web.WebSocketResponse(heartbeat=20)
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        # a fixed receive buffer (~2 s of PCM16 at 16 kHz) rather than one autotuned up to tcp_rmem's
        # maximum (tens of MB: minutes of audio), so that back-pressure reaches the client
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    try:
        await ws.prepare(request)
    except BaseException:  # not a WebSocket after all (or the client left): nothing is kept for it
        stream.abort("the WebSocket upgrade failed")
        if voice is not None:
            await voice.abort()
        raise
    if voice is not None:
        voice.stream = stream
        voice.start()
    # Back-pressure: while the stream's unprocessed audio is over its bound this handler does not
    # read the socket (aiohttp then pauses the transport, and TCP slows the client down). A
    # backlog that does not drain within ``stall_s`` (under the heartbeat's 10 s pong wait) means the
    # server cannot keep up at all: an "overloaded" error and close 1013 (try again later).
    stall_s = 5.0

    async def until(done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = loop.time() + timeout_s
        while not done():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def pump() -> None:
        while True:
            event = await outbox.get()
            if event is None:
                return
            if ws.closed:
                continue  # the client left: its remaining events have nobody to go to
            try:
                await ws.send_json(event)
            except ConnectionError:
                continue

    def gone() -> bool:  # the connection is closing: audio still buffered from it has nobody to answer
        return request.transport is None or request.transport.is_closing()

    sender = asyncio.create_task(pump())
    ended, overloaded = False, None
    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                if gone():
                    break
                await loop.run_in_executor(None, stream.push, msg.data)
                if stream.over_backlog and not await until(lambda: not stream.over_backlog or gone(), stall_s):
                    overloaded = (
                        f"the recogniser is {stream.backlog_s:.1f} s of audio behind this stream and "
                        f"did not catch up within {stall_s:g} s; retry later or send in real time"
                    )
                    break
            elif msg.type == WSMsgType.TEXT and msg.data.strip() in _END:
                ended = True
                break
            elif msg.type == WSMsgType.TEXT and voice is not None and msg.data.lstrip().startswith("{"):
                try:
                    voice.configure(msg.data)
                except InputError as exc:
                    await ws.send_json(_stream_error("bad_message", str(exc)))
            elif msg.type == WSMsgType.TEXT:
                await ws.send_json(_stream_error("bad_message", 'send binary PCM16 frames, then "end"'))
    finally:
        if ended:  # the finals, within the stream's close timeout; past it, errors for what is open
            stream.end()
            await until(lambda: stream.finished, stream.close_timeout_s)
            stream.close(0)
        elif overloaded:
            stream.abort(overloaded, "overloaded")
            log.warning("ASR stream closed: %s", overloaded)
            # queued like the stream's own events, so it comes after their utterance errors
            outbox.post(_stream_error("overloaded", overloaded))
        else:  # the client went away: drop its work rather than finish it for nobody
            stream.abort("the client closed the connection")
        if voice is not None:  # each final's reply, after the finals (or none: the client left)
            await (voice.finish() if ended else voice.abort())
        outbox.post(None)  # after every event the stream emitted
        await sender
        if overloaded:
            await ws.close(code=1013, message=b"overloaded: the recogniser cannot keep up")
        else:
            await ws.close()
    return ws


def _stream_error(code: str, message: str) -> dict:
    """An error about the whole stream (not one utterance), keyed like every other event: ``kind``
    ``error``, its ``code``, and the text as both ``message`` and ``error`` (an utterance's field)."""
    return {"kind": "error", "code": code, "message": message, "error": message}
