"""The Wyoming server under a hostile or buggy client, in this process over a stand-in ASR ladder
(``tests/wyoming_harness.py``): events with missing or mistyped fields, JSON nested past the parser's
depth, sample rates that would take gigabytes to convert, a stop with idle connections open, and client
strings long enough to flood the log. Each case closes only its own connection with one log line and no
traceback; the server goes on serving."""

from __future__ import annotations

import asyncio
import socket
import tracemalloc

import pytest

pytest.importorskip("wyoming")
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info

from tests.wyoming_harness import LINE_MAX, Harness, event_bytes, exchange, still_serves


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.stop()


def _no_traceback(h: Harness) -> None:
    lines = h.lines()
    assert not [line for line in lines if "Traceback" in line or "internal error" in line], lines
    assert not [r for r in h.records if r.levelname in ("ERROR", "CRITICAL")], lines


def _closed_lines(h: Harness) -> list[str]:
    return [line for line in h.lines() if "closed:" in line]


START = {"rate": 16000, "width": 2, "channels": 1}


@pytest.mark.parametrize(
    ("events", "said"),
    [
        ([event_bytes("audio-start", {"rate": 16000, "width": 2})], "audio-start: 'channels' is missing"),
        ([event_bytes("audio-start", {})], "audio-start: 'rate' is missing"),
        ([event_bytes("audio-start")], "audio-start: 'rate' is missing"),
        ([event_bytes("audio-start", {**START, "channels": "1"})], "audio-start: 'channels' is '1'"),
        ([event_bytes("audio-start", START), event_bytes("audio-chunk", {})], "audio-chunk: 'rate' is missing"),
        ([event_bytes("transcript", {})], "transcript: 'text' is missing"),
        ([event_bytes("transcript", {"text": 123})], "transcript: 'text' is 123"),
        ([event_bytes("transcribe", {"language": 7}), event_bytes("audio-start", START)], "'language' is 7"),
        ([event_bytes("audio-start", {**START, "timestamp": "now"})], "'timestamp' is 'now'"),
    ],
)
def test_missing_or_mistyped_fields_close_the_connection_with_one_line(harness, events, said):
    exchange(harness.port, b"".join(events))
    lines = _closed_lines(harness)
    assert len(lines) == 1 and said in lines[0], harness.lines()
    _no_traceback(harness)
    still_serves(harness.port)


@pytest.mark.parametrize("where", ["header", "data"])
def test_json_nested_past_the_parser_is_one_line(harness, where):
    deep = b"[" * 30_000 + b"]" * 30_000
    if where == "header":
        raw = b'{"type": "x", "data": ' + deep + b"}\n"
    else:
        body = b'{"a": ' + deep + b"}"
        raw = b'{"type": "x", "data_length": %d}\n' % len(body) + body
    assert len(raw) < 64 * 1024 * 2
    exchange(harness.port, raw)
    lines = _closed_lines(harness)
    assert len(lines) == 1 and "nested" in lines[0], harness.lines()
    _no_traceback(harness)
    still_serves(harness.port)


@pytest.mark.parametrize("rate", [1, 4000, 7999, 48001, 384000])
def test_a_rate_outside_the_range_is_refused_at_audio_start(harness, rate):
    # 200 bytes at 1 Hz: 200 s of audio that once took over a gigabyte to convert
    raw = event_bytes("audio-start", {**START, "rate": rate, "width": 1})
    raw += event_bytes("audio-chunk", {**START, "rate": rate, "width": 1}, b"\x10" * 200)
    exchange(harness.port, raw)
    lines = _closed_lines(harness)
    assert len(lines) == 1 and f"sample rate {rate} Hz is outside 8000..48000" in lines[0], harness.lines()
    assert harness.asr.streams == [] or harness.asr.streams[0].fed == 0
    _no_traceback(harness)


def test_audio_past_max_audio_s_is_refused_before_it_is_converted():
    h = Harness(max_audio_s=120.0)
    try:
        fmt = {"rate": 8000, "width": 1, "channels": 1}
        raw = event_bytes("audio-start", fmt) + event_bytes("audio-chunk", fmt, b"\x10" * (1 << 20))  # 131 s
        tracemalloc.start()
        try:
            exchange(h.port, raw)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        lines = _closed_lines(h)
        assert len(lines) == 1 and "more than 120 s of audio" in lines[0], h.lines()
        assert h.asr.streams[0].fed == 0
        assert peak < 24 << 20, f"{peak / 2**20:.0f} MiB"  # the 1 MiB payload and its reading, not a conversion
    finally:
        h.stop()


@pytest.mark.parametrize(("rate", "width"), [(8000, 1), (11025, 1), (47999, 2), (48000, 4), (44100, 1)])
def test_one_largest_chunk_converts_in_bounded_memory(rate, width):
    from edge_agent.serving.doors.wyoming.audio import AudioConverter

    conv = AudioConverter(rate, width, 1, 16000)
    conv.convert(b"\x01" * width * 64)  # the kernel built once, outside the measurement
    payload = b"\x01\x02\x03\x04" * (1 << 18)  # 1 MiB: the protocol's largest payload
    tracemalloc.start()
    try:
        out = conv.convert(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    n = (1 << 20) // width
    assert abs(len(out) // 2 - n * 16000 / rate) <= 64  # every sample converted (less the filter's delay)
    # the input as float32, the output as float32 and PCM16, and a fixed window budget: about 4 + 12 + 8 MiB
    # at worst (8 kHz 8-bit doubles 1 Mi samples); the whole window matrix at once was 860 MB
    assert peak < 40 << 20, f"{peak / 2**20:.0f} MiB"


def test_stop_with_idle_connections_is_clean():
    h = Harness()
    socks = []
    try:
        for _ in range(3):  # each connection's session is reading: it answered a describe
            s = socket.create_connection(("127.0.0.1", h.port), timeout=10)
            s.sendall(event_bytes("describe"))
            got = b""
            while b"\n" not in got:
                got += s.recv(65536)
            assert got.startswith(b"{") and b'"info"' in got
            socks.append(s)
        assert h.server.connections == 3
    finally:
        h.stop()
        for s in socks:
            s.close()
    _no_traceback(h)
    assert not [line for line in h.lines() if "CancelledError" in line], h.lines()
    assert h.server.connections == 0


def test_client_strings_in_log_lines_are_clipped(harness):
    long_type = "x" * 60_000
    exchange(
        harness.port, event_bytes(long_type, {"a": 1}) + b'{"type": "' + b"y" * 60_000 + b'", "data_length": -1}\n'
    )

    async def language():
        client = AsyncTcpClient("127.0.0.1", harness.port)
        await client.connect()
        await client.write_event(Transcribe(language="q" * 5000).event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        event = await asyncio.wait_for(client.read_event(), 30)
        await client.disconnect()
        return event

    event = asyncio.run(language())
    assert Error.is_type(event.type)
    text = Error.from_event(event).text
    assert "qqqq" in text and len(text) < LINE_MAX, len(text)
    lines = harness.lines()
    assert any("data_length -1" in line for line in lines), lines
    assert any("refused (language)" in line for line in lines), lines
    assert max(len(line) for line in lines) < LINE_MAX, sorted(len(line) for line in lines)[-3:]
    _no_traceback(harness)


def test_describe_and_a_transcript_still_work(harness):
    async def go():
        client = AsyncTcpClient("127.0.0.1", harness.port)
        await client.connect()
        await client.write_event(Describe().event())
        info = Info.from_event(await asyncio.wait_for(client.read_event(), 30))
        await client.write_event(Transcript(text="hello").event())
        answer = await asyncio.wait_for(client.read_event(), 30)
        await client.disconnect()
        return info, answer

    info, answer = asyncio.run(go())
    assert [m.name for m in info.asr[0].models] == ["ctc"]
    assert answer.type == "not-handled"  # no LLM ladder here
