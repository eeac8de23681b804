"""One Wyoming connection: its requests on the ASR and LLM ladders, the same serving layer the HTTP API uses.

Speech to text (``transcribe`` is optional; HA sends it first)::

    -> transcribe {name?, language?}, audio-start {rate, width, channels}, audio-chunk*, audio-stop
    <- transcript-start, transcript-chunk {text}*, transcript {text}, transcript-stop

The audio is converted to the active ASR tier's PCM16 mono (``audio``) and fed to a live stream
on the ladder (``TieredSpeech.open_stream``, as ``GET /v1/audio/stream`` does): its endpointer, batching,
SLA window and tier switches apply, and every utterance is observed (``/metrics``, telemetry). A chunk's
text is what became stable since the last one (the text a partial's ``stable_text`` added: it is never
taken back), and at the end what the final adds when it begins with what was sent; ``transcript`` is the
finals of the request's utterances joined by spaces. A Whisper final (its one pass over the window) may
revise a committed word: its utterance's chunks then stop, and only ``transcript`` carries the revision.
A request the ladder refuses (shedding, a language or model it does not serve) and an utterance that
fails get an ``error`` event (``code``: ``unavailable``, ``language``, ``model``, or the utterance's
``overloaded`` / ``timeout`` / ``failed``) instead of a transcript; the connection stays open.

Conversation (``transcript`` from the client, when the LLM is offered)::

    -> transcript {text}
    <- handled-start, handled-chunk {text}*, handled {text}, handled-stop    (not-handled {text}: refused)

The reply comes from the LLM ladder (``TieredLLM.submit``), tokens streamed as they come.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from ....errors import EdgeAgentError, InputError
from ...llm.handle import RequestHandle, TokenEvent
from ..host import Mailbox
from ..ladders import SpeechStream
from .audio import AudioConverter
from .info import Offer, asr_language, check_request, server_info
from .protocol import WRITE_TIMEOUT_S, ProtocolError, clip, read_event

log = logging.getLogger(__name__)
STALL_S = 5.0  # the recogniser this far behind a stream (after its backlog bound) is overloaded
HOLD_MAX_S = 30.0  # audio of a client faster than real time gathered before it is fed (Whisper's window)


class Session:
    """One connection (see the module doc): ``run`` reads and answers events until the client is done."""

    def __init__(self, offer: Offer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, who: str):
        import wyoming.asr
        import wyoming.audio
        import wyoming.error
        import wyoming.event
        import wyoming.handle
        import wyoming.info

        self.w_asr, self.w_audio, self.w_error = wyoming.asr, wyoming.audio, wyoming.error
        self.w_event, self.w_handle, self.w_info = wyoming.event, wyoming.handle, wyoming.info
        self.offer, self.reader, self.writer, self.who = offer, reader, writer, who
        self.cfg = offer.config
        self.loop = asyncio.get_running_loop()
        self._write_lock = asyncio.Lock()
        self.request: Any = None  # the pending ``Transcribe``
        self.stream: SpeechStream | None = None  # the ASR stream of the request in progress
        self.converter: AudioConverter | None = None
        self.refused = False  # the request was answered with an error: its audio is read and dropped
        self._asr_events: Mailbox[dict | None] = Mailbox(self.loop)  # from the ASR thread
        self._pump: asyncio.Task | None = None
        self._reply: RequestHandle | None = None  # the LLM request in progress
        self._held: list[bytes] = []  # converted audio of a client sending faster than real time
        self._held_s = 0.0
        self._last_chunk_at = 0.0

    # -- plumbing ----------------------------------------------------------------------------

    async def write(self, eventable: Any) -> None:
        async with self._write_lock:
            event = eventable.event() if hasattr(eventable, "event") else eventable
            await asyncio.wait_for(self.w_event.async_write_event(event, self.writer), WRITE_TIMEOUT_S)

    async def error(self, text: str, code: str) -> None:
        log.info("Wyoming request from %s refused (%s): %s", self.who, code, text)
        await self.write(self.w_error.Error(text=text, code=code))

    async def run(self) -> None:
        while (event := await read_event(self.reader, self.cfg.idle_timeout_s)) is not None:
            await self.dispatch(event)

    async def dispatch(self, event: Any) -> None:
        a, asr, info = self.w_audio, self.w_asr, self.w_info
        if info.Describe.is_type(event.type):
            self.offer.count("describe", "ok")
            await self.write(server_info(self.offer))
        elif asr.Transcribe.is_type(event.type):
            self.request = asr.Transcribe.from_event(event)
        elif a.AudioStart.is_type(event.type):
            await self.audio_start(event)
        elif a.AudioChunk.is_type(event.type):
            await self.audio_chunk(event)
        elif a.AudioStop.is_type(event.type):
            await self.audio_stop()
        elif asr.Transcript.is_type(event.type):
            await self.handle(asr.Transcript.from_event(event).text)
        elif event.type in ("ping",):
            await self.write(self.w_event.Event(type="pong", data=event.data or {}))
        else:  # an event for another service (wake, tts, …): not ours to answer, not a fault either
            log.debug("Wyoming event %s from %s ignored", clip(event.type), self.who)

    async def close(self, logged: bool = False) -> None:
        """The connection is ending: work still open for it is dropped, not finished for nobody (``logged``:
        why was said already)."""
        if self.stream is not None and not logged:
            log.info(
                "Wyoming connection from %s ended in the middle of a request: its %.1f s of audio are dropped",
                self.who,
                self.converter.seconds if self.converter is not None else 0.0,
            )
        if self.stream is not None:
            self.stream.abort("the Wyoming connection closed")
            self.stream = None
        if self._pump is not None:
            self._pump.cancel()
        if self._reply is not None:
            self._reply.cancel()

    # -- speech to text ----------------------------------------------------------------------

    async def audio_start(self, event: Any) -> None:
        if self.stream is not None:
            raise ProtocolError("audio-start while a request's audio is still open (no audio-stop)")
        start = self.w_audio.AudioStart.from_event(event)
        request, self.request = self.request, None
        asr = self.offer.asr
        self.refused = True  # until the stream is open
        if asr is None:
            self.offer.count("transcribe", "unavailable")
            await self.error("no ASR tier is configured", "unavailable")
            return
        engine = asr.active_engine
        rate = int(getattr(engine, "sample_rate", 16000))
        self.converter = AudioConverter(start.rate, start.width, start.channels, rate)  # BadAudio closes it
        try:
            check_request(request, asr, asr_language(engine))
            self.stream = asr.open_stream(self._asr_events.post)
        except InputError as exc:
            self.offer.count("transcribe", "refused")
            await self.error(str(exc), getattr(exc, "code", "refused"))
            return
        except EdgeAgentError as exc:
            self.offer.count("transcribe", "unavailable")
            await self.error(str(exc), "unavailable")
            return
        self.refused = False
        self._held, self._held_s, self._last_chunk_at = [], 0.0, self.loop.time()
        self._finals: dict[int, str] = {}
        self._sent: dict[int, str] = {}
        self._errors: list[dict] = []
        self._any_sent = False
        await self.write(self.w_asr.TranscriptStart(language=asr_language(engine)))
        self._pump = asyncio.create_task(self._pump_events())

    async def audio_chunk(self, event: Any) -> None:
        if self.converter is None:
            raise ProtocolError("audio-chunk before audio-start")
        chunk = self.w_audio.AudioChunk.from_event(event)
        if not self.converter.same_format(chunk.rate, chunk.width, chunk.channels):
            raise ProtocolError(
                f"an audio chunk of {chunk.rate} Hz × {chunk.width} bytes × {chunk.channels} channel(s) after "
                f"audio-start said {self.converter.rate} Hz × {self.converter.width} × {self.converter.channels}"
            )
        if self.converter.seconds + self.converter.seconds_in(chunk.audio or b"") > self.cfg.max_audio_s:
            raise ProtocolError(f"more than {self.cfg.max_audio_s:g} s of audio in one request (wyoming.max_audio_s)")
        pcm = self.converter.convert(chunk.audio or b"")
        if self.refused or self.stream is None:
            return
        # A client sending faster than real time (a recording, not a microphone) would have each piece
        # of its audio decoded as a partial nobody waits for: its audio is gathered (up to HOLD_MAX_S)
        # and fed at once, recognised in one pass at its end. A client in real time is fed as it speaks.
        now, chunk_s = self.loop.time(), len(pcm) / 2 / self.converter.target_rate
        fast = now - self._last_chunk_at < 0.5 * chunk_s
        self._last_chunk_at = now
        if fast and self._held_s + chunk_s <= HOLD_MAX_S:
            self._held.append(pcm)
            self._held_s += chunk_s
            return
        if self._held:
            pcm, self._held, self._held_s = b"".join([*self._held, pcm]), [], 0.0
        await self._push(pcm)

    async def _push(self, pcm: bytes, end: bool = False) -> None:
        stream = self.stream
        assert stream is not None

        def push() -> None:
            stream.push(pcm)
            if end:  # in the same call: a step that starts meanwhile finds the end with the audio
                stream.end()

        await self.loop.run_in_executor(None, push)
        if not end and stream.over_backlog:
            deadline = self.loop.time() + STALL_S
            while stream.over_backlog and self.loop.time() < deadline:
                await asyncio.sleep(0.02)
            if stream.over_backlog:
                why = (
                    f"the recogniser is {stream.backlog_s:.1f} s of audio behind and did not catch up in {STALL_S:g} s"
                )
                stream.abort(why, "overloaded")
                self.stream = None
                self.offer.count("transcribe", "overloaded")
                await self.error(why, "overloaded")
                self.refused = True

    async def audio_stop(self) -> None:
        if self.converter is None:
            raise ProtocolError("audio-stop before audio-start")
        converter = self.converter
        if self.refused or self.stream is None:
            self.refused, self.converter, self.stream = False, None, None
            return
        await self._push(b"".join([*self._held, converter.flush()]), end=True)
        self._held, self._held_s, self.converter = [], 0.0, None
        stream, self.stream = self.stream, None
        assert stream is not None
        deadline = self.loop.time() + stream.close_timeout_s
        while not stream.finished and self.loop.time() < deadline:
            await asyncio.sleep(0.005)
        stream.close(0)  # past the deadline: open utterances get errors (timeout), as the HTTP API does
        # posted behind the stream's own events: after all of them
        self._asr_events.post(None)
        pump, self._pump = self._pump, None
        if pump is not None:
            await pump
        if self._errors:
            first = self._errors[0]
            self.offer.count("transcribe", first.get("code") or "failed")
            await self.error(f"utterance {first.get('utterance')}: {first.get('error')}", first.get("code") or "failed")
            return
        text = " ".join(t for _, t in sorted(self._finals.items()) if t)
        await self.write(self.w_asr.Transcript(text=text))
        await self.write(self.w_asr.TranscriptStop())
        self.offer.count("transcribe", "ok")

    async def _pump_events(self) -> None:
        """ASR events -> ``transcript-chunk``: per utterance, the text that became stable since the last chunk."""
        while (event := await self._asr_events.get()) is not None:
            kind, u = event.get("kind"), event.get("utterance", 0)
            if kind == "error":
                self._errors.append(event)
                continue
            if kind == "final":
                self._finals[u] = event.get("text", "")
                stable = self._finals[u]
            elif kind == "partial":
                stable = event.get("stable_text", "")
            else:
                continue
            sent = self._sent.get(u, "")
            if not stable.startswith(sent) or len(stable) == len(sent):
                continue
            delta = stable[len(sent) :]
            if not sent and self._any_sent:
                delta = " " + delta.lstrip()
            self._sent[u] = stable
            self._any_sent = True
            await self.write(self.w_asr.TranscriptChunk(text=delta))

    # -- conversation ------------------------------------------------------------------------

    async def handle(self, text: str) -> None:
        h = self.w_handle
        llm = self.offer.llm
        if llm is None or not self.cfg.handle:
            self.offer.count("handle", "unavailable")
            await self.write(h.NotHandled(text="this server has no conversation agent (no LLM tier)"))
            return
        from ....models.sampling import SamplingParams
        from ....models.tokenizer import Message

        chat = [Message("system", self.cfg.system_prompt)] if self.cfg.system_prompt else []
        chat.append(Message("user", text))
        params = SamplingParams(max_new_tokens=self.cfg.max_reply_tokens)
        try:  # tokenizing is model work: on the executor, never on the loop
            reply = await self.loop.run_in_executor(None, functools.partial(llm.submit, chat, params))
        except EdgeAgentError as exc:
            self.offer.count("handle", "refused")
            await self.write(h.NotHandled(text=str(exc)))
            return
        self._reply = reply
        tokens: Mailbox[TokenEvent | None] = Mailbox(self.loop)
        reply.set_sink(tokens.post)
        await self.write(h.HandledStart())
        while (ev := await tokens.get()) is not None:
            if ev.text:
                await self.write(h.HandledChunk(text=ev.text))
        self._reply = None
        try:
            completion = reply.result(0)
        except Exception as exc:
            self.offer.count("handle", "failed")
            await self.write(h.NotHandled(text=f"the reply failed: {exc}"))
            await self.write(h.HandledStop())
            return
        await self.write(h.Handled(text=completion.text))
        await self.write(h.HandledStop())
        self.offer.count("handle", "ok")
