"""The Wyoming server's bounded event reader and its audio conversion, against plain references: the
``wyoming`` library's own writer for the wire format, and numpy for the sample formats."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("wyoming")
from wyoming.audio import AudioChunk
from wyoming.event import async_write_event

from edge_agent.serving.doors.wyoming.audio import AudioConverter, BadAudio
from edge_agent.serving.doors.wyoming.protocol import MAX_LINE, ProtocolError, read_event


class _Sink:
    """A StreamWriter stand-in collecting what the library writes."""

    def __init__(self) -> None:
        self.data = b""

    def writelines(self, parts) -> None:
        self.data += b"".join(parts)

    def write(self, part: bytes) -> None:
        self.data += part

    async def drain(self) -> None:
        return None


def _read(raw: bytes, idle_s: float = 1.0):
    async def go():
        reader = asyncio.StreamReader(limit=MAX_LINE)
        reader.feed_data(raw)
        reader.feed_eof()
        return await read_event(reader, idle_s)

    return asyncio.run(go())


def test_reads_what_the_library_writes():
    sink = _Sink()
    chunk = AudioChunk(rate=22050, width=2, channels=2, audio=b"\x01\x02" * 100, timestamp=5)
    asyncio.run(async_write_event(chunk.event(), sink))  # type: ignore[arg-type]
    event = _read(sink.data)
    back = AudioChunk.from_event(event)
    assert (back.rate, back.width, back.channels, back.audio, back.timestamp) == (22050, 2, 2, chunk.audio, 5)
    assert _read(b"") is None  # a clean end of the connection


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"hello there\n", "not a JSON line"),
        (b"[1, 2]\n", "no 'type'"),
        (b'{"type": "x", "payload_length": 10}\n' + b"abc", "closed before its data"),
        (b'{"type": "x", "payload_length": 99999999999}\n', "payload_length"),
        (b'{"type": "x", "data_length": -1}\n', "data_length"),
        (b'{"type": "x", "data_length": 3}\nabc', "not JSON"),
        (b"x" * (MAX_LINE + 10), "longer than"),
        (b'{"type": "x"', "in the middle of an event"),
    ],
)
def test_bad_wire_data_is_a_protocol_error(raw, said):
    with pytest.raises(ProtocolError, match=said):
        _read(raw)


def test_an_idle_client_times_out():
    async def go():
        reader = asyncio.StreamReader()
        return await read_event(reader, 0.05)  # nothing is ever fed

    with pytest.raises(ProtocolError, match="nothing received"):
        asyncio.run(go())


def test_sample_formats_decode_like_numpy():
    rng = np.random.default_rng(0)
    x = rng.uniform(-0.9, 0.9, (400, 2))
    # 16-bit stereo: the mean of the channels
    i16 = np.round(x * 32767).astype("<i2")
    out = np.frombuffer(AudioConverter(16000, 2, 2, 16000).convert(i16.tobytes()), "<i2")
    want = np.clip(np.rint(i16.astype(np.float64).mean(axis=1) / 32768 * 32768), -32768, 32767)
    np.testing.assert_array_equal(out, want)
    # 24-bit little-endian signed, mono
    v = np.round(x[:, 0] * (2**23 - 1)).astype(np.int64)
    raw = b"".join(int(s).to_bytes(3, "little", signed=True) for s in v)
    out = np.frombuffer(AudioConverter(16000, 3, 1, 16000).convert(raw), "<i2")
    np.testing.assert_allclose(out, np.rint(v / 2**23 * 32768), atol=1)
    # 8-bit signed and 32-bit
    i8 = np.round(x[:, 0] * 127).astype(np.int8)
    out = np.frombuffer(AudioConverter(16000, 1, 1, 16000).convert(i8.tobytes()), "<i2")
    np.testing.assert_array_equal(out, i8.astype(np.int32) * 256)
    i32 = np.round(x[:, 0] * (2**31 - 1)).astype("<i4")
    out = np.frombuffer(AudioConverter(16000, 4, 1, 16000).convert(i32.tobytes()), "<i2")
    np.testing.assert_allclose(out, np.rint(i32 / 2**31 * 32768), atol=1)


def test_rate_conversion_keeps_a_tone_and_its_length():
    rate, f = 48000, 440.0
    t = np.arange(rate) / rate
    pcm = (np.sin(2 * np.pi * f * t) * 0.5 * 32767).astype("<i2").tobytes()
    conv = AudioConverter(rate, 2, 1, 16000)
    step = 4800 * 2 + 2  # chunks that do not fall on the 3:1 ratio
    out = b"".join(conv.convert(pcm[i : i + step]) for i in range(0, len(pcm), step)) + conv.flush()
    y = np.frombuffer(out, "<i2").astype(np.float64) / 32768
    assert abs(len(y) - 16000) <= 1
    spectrum = np.abs(np.fft.rfft(y[:16000] * np.hanning(16000)))
    assert abs(np.argmax(spectrum) - f) <= 1  # 1 Hz bins
    assert np.sqrt(np.mean(y[1000:15000] ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.02)


@pytest.mark.parametrize(
    ("fmt", "said"),
    [((0, 2, 1), "sample rate 0"), ((16000, 5, 1), "width 5"), ((16000, 2, 0), "0 channels"), (("x", 2, 1), "integer")],
)
def test_impossible_formats_are_refused(fmt, said):
    with pytest.raises(BadAudio, match=said):
        AudioConverter(*fmt, 16000)


def test_a_chunk_of_partial_frames_is_refused():
    with pytest.raises(BadAudio, match="3 bytes is not whole frames of 4 bytes"):
        AudioConverter(16000, 2, 2, 16000).convert(b"\0\0\0")


def test_config_refuses_a_reachable_host_without_consent():
    from pydantic import ValidationError

    from edge_agent.config import WyomingConfig

    with pytest.raises(ValidationError, match="no authentication"):
        WyomingConfig(enabled=True, host="0.0.0.0")
    assert WyomingConfig(enabled=True, host="0.0.0.0", allow_remote=True).port == 10300
    assert WyomingConfig(enabled=False, host="0.0.0.0").enabled is False
    json.dumps(WyomingConfig().model_dump())
