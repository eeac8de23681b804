"""A ``WyomingServer`` in this process over a stand-in ASR ladder, for driving the server's wire handling
with the ``wyoming`` client and raw sockets without loading a model.

``FakeSpeech`` is what the session reads of ``TieredSpeech``: one tier, a 16 kHz English recogniser, and
streams that count the PCM they are fed and answer ``end()`` with one final (``"ok"``). The server's log
records are collected (``Harness.records``) so a test can check each line it wrote.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass, field

LINE_MAX = 400  # no log line the server writes about a client is longer than this


@dataclass
class _Tier:
    name: str


@dataclass
class _Engine:
    sample_rate: int = 16000
    language: str = "en"


class FakeStream:
    """One ASR stream: PCM fed is counted; ``end()`` finishes it with a final."""

    close_timeout_s = 5.0
    backlog_s = 0.0
    over_backlog = False

    def __init__(self, sink) -> None:
        self.sink, self.fed, self.finished, self.aborted = sink, 0, False, None

    def push(self, pcm: bytes) -> None:
        self.fed += len(pcm)

    def end(self) -> None:
        self.sink({"kind": "final", "utterance": 0, "text": "ok"})
        self.finished = True

    def abort(self, why: str, code: str = "failed") -> None:
        self.aborted = why

    def close(self, timeout_s: float = 0) -> None:
        self.finished = True


@dataclass
class FakeSpeech:
    """The parts of the ASR ladder a Wyoming session uses."""

    tiers: list = field(default_factory=lambda: [_Tier("ctc")])
    active_tier: str = "ctc"
    active_engine: _Engine = field(default_factory=_Engine)
    streams: list = field(default_factory=list)

    def open_stream(self, sink) -> FakeStream:
        stream = FakeStream(sink)
        self.streams.append(stream)
        return stream


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.guard = threading.Lock()  # not ``lock``: Handler.handle holds that one around emit

    def emit(self, record: logging.LogRecord) -> None:
        with self.guard:
            self.records.append(record)


class Harness:
    """A started server on a free loopback port; ``stop()`` stops it and detaches the log handler."""

    def __init__(self, **config) -> None:
        from edge_agent.config import WyomingConfig
        from edge_agent.serving.doors.wyoming.server import WyomingServer

        self.asr = FakeSpeech()
        self._handler = _Collect()
        for name in ("edge_agent.serving", "asyncio"):
            logging.getLogger(name).addHandler(self._handler)
        self._old_level = logging.getLogger("edge_agent.serving").level
        logging.getLogger("edge_agent.serving").setLevel(logging.DEBUG)
        cfg = WyomingConfig(enabled=True, port=0, **{"idle_timeout_s": 10.0, **config})
        self.server = WyomingServer(cfg, asr=self.asr).start()
        assert self.server.address is not None
        self.port = self.server.address[1]

    @property
    def records(self) -> list[logging.LogRecord]:
        with self._handler.guard:
            return list(self._handler.records)

    def lines(self) -> list[str]:
        """Every log line (message and any traceback) the server wrote."""
        out = []
        for r in self.records:
            text = r.getMessage()
            if r.exc_info:
                text += "\n" + logging.Formatter().formatException(r.exc_info)
            out.append(text)
        return out

    def stop(self) -> None:
        self.server.stop()
        for name in ("edge_agent.serving", "asyncio"):
            logging.getLogger(name).removeHandler(self._handler)
        logging.getLogger("edge_agent.serving").setLevel(self._old_level)


def exchange(port: int, data: bytes, read_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh socket, then read until the server closes it; what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        got = b""
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return got
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def event_bytes(kind: str, data: dict | None = None, payload: bytes = b"") -> bytes:
    """One event on the wire, its data as the additional-data block (as the library writes it)."""
    import json

    header: dict = {"type": kind, "version": "1.10.2"}
    body = json.dumps(data).encode() if data is not None else b""
    if body:
        header["data_length"] = len(body)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + body + payload


def still_serves(port: int) -> None:
    """One whole request on a fresh connection ends with ``transcript`` and ``transcript-stop``."""
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    async def go() -> list[str]:
        client = AsyncTcpClient("127.0.0.1", port)
        await client.connect()
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=b"\0\0" * 1600).event())
        await client.write_event(AudioStop().event())
        types: list[str] = []
        while not types or types[-1] not in ("transcript-stop", "error"):
            event = await asyncio.wait_for(client.read_event(), 30)
            assert event is not None, types
            types.append(event.type)
        await client.disconnect()
        return types

    types = asyncio.run(go())
    assert types[-2:] == ["transcript", "transcript-stop"], types
