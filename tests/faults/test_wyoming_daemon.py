"""The Wyoming server of a real ``edge-agent run`` (demo-asr and demo-phi3 tiers), driven with the ``wyoming``
library's own client: describe, speech to text in formats other than the recogniser's, streamed chunks,
four streams at once, a conversation turn, and bad input (garbage, odd chunks, a rate of 0, too much audio,
a client that vanishes, more idle connections than allowed), each closing only its own connection with
a log line while the server goes on serving."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request

import numpy as np
import pytest

from tests.daemon_proc import Daemon, free_port, speech_daemon
from tests.mqtt_broker import Broker, wait_for
from tests.speech import require_tools, speech_samples

pytest.importorskip("wyoming")
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop
from wyoming.info import Describe, Info

SENTENCE = "turn on the kitchen light"
MAX_CONNECTIONS = 8
IDLE_S = 2.0
MAX_AUDIO_S = 20.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    require_tools()
    tmp = tmp_path_factory.mktemp("wyoming")
    broker = Broker(tmp).start()
    d = speech_daemon(tmp, broker.port)
    d.wyoming_port = free_port()
    d.cfg.write_text(
        d.cfg.read_text()
        + f"""
[wyoming]
enabled = true
port = {d.wyoming_port}
max_connections = {MAX_CONNECTIONS}
idle_timeout_s = {IDLE_S}
max_audio_s = {MAX_AUDIO_S}
"""
    )
    try:
        d.start(timeout_s=240)
        yield d
    finally:
        out = d.close()
        broker.stop()
        print(out[-6000:])


def _pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def _transcribe(
    port: int, pcm: bytes, rate: int, width: int, channels: int, chunk_ms: int = 100, real_time: bool = False
) -> dict:
    """One request; every event back, in order (``before_stop``: those that came before audio-stop was sent).
    ``real_time``: chunks paced as a microphone sends them."""
    client = AsyncTcpClient("127.0.0.1", port)
    await client.connect()
    events: list = []
    early: list = []

    async def read_early() -> None:
        while True:
            event = await client.read_event()
            if event is None:
                return
            early.append(event)

    try:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=rate, width=width, channels=channels).event())
        reader = asyncio.create_task(read_early()) if real_time else None
        step = rate * width * channels * chunk_ms // 1000
        step -= step % (width * channels)
        for i in range(0, len(pcm), step):
            await client.write_event(
                AudioChunk(rate=rate, width=width, channels=channels, audio=pcm[i : i + step]).event()
            )
            if real_time:
                await asyncio.sleep(chunk_ms / 1000)
        if reader is not None:
            reader.cancel()
            events.extend(early)
        before_stop = [e.type for e in events]
        sent = time.monotonic()
        await client.write_event(AudioStop().event())
        while True:
            event = await asyncio.wait_for(client.read_event(), 60)
            assert event is not None, f"the server closed the connection after {[e.type for e in events]}"
            events.append(event)
            if TranscriptStop.is_type(event.type) or Error.is_type(event.type):
                break
    finally:
        await client.disconnect()
    final = next((Transcript.from_event(e).text for e in events if Transcript.is_type(e.type)), None)
    chunks = [TranscriptChunk.from_event(e).text for e in events if TranscriptChunk.is_type(e.type)]
    return {
        "types": [e.type for e in events],
        "before_stop": before_stop,
        "text": final,
        "chunks": chunks,
        "after_stop_s": time.monotonic() - sent,
    }


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def _upload_text(d: Daemon, samples16k: np.ndarray) -> str:
    """The same audio through the HTTP API's transcription route (the other adapter on the same ladder)."""
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples16k, 16000, format="WAV", subtype="PCM_16")
    boundary = "----edgeagent"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + buf.getvalue()
        + f"\r\n--{boundary}--\r\n".encode()
    )
    req = urllib.request.Request(
        d.url("/v1/audio/transcriptions"),
        data=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    import json

    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["text"]


def test_describe_lists_the_asr_tiers_and_the_llm(daemon):
    async def go():
        client = AsyncTcpClient("127.0.0.1", daemon.wyoming_port)
        await client.connect()
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), 30)
        await client.disconnect()
        return Info.from_event(event)

    info = asyncio.run(go())
    assert [m.name for m in info.asr[0].models] == ["ctc"]
    assert info.asr[0].models[0].languages == ["en"]
    assert info.asr[0].supports_transcript_streaming
    assert [m.name for m in info.handle[0].models] == ["small"]
    assert info.handle[0].supports_handled_streaming


def test_transcripts_in_any_format_equal_the_http_route(daemon):
    x16 = speech_samples(SENTENCE)
    want = _upload_text(daemon, x16)
    assert _words(want) == _words(SENTENCE)  # demo-asr knows its domain: the reference itself is right
    res = asyncio.run(_transcribe(daemon.wyoming_port, _pcm16(x16), 16000, 2, 1))
    assert res["types"][0] == "transcript-start" and res["types"][-2:] == ["transcript", "transcript-stop"]
    assert res["text"] == want
    joined = "".join(res["chunks"])
    assert joined.strip() and want.startswith(joined.strip())  # chunks: stable text, never taken back
    # 48 kHz stereo 24-bit, and 8 kHz mono 8-bit: converted to the tier's 16 kHz PCM16
    t = np.arange(int(len(x16) * 3)) / 48000
    x48 = np.interp(t, np.arange(len(x16)) / 16000, x16)
    stereo = np.stack([x48, x48 * 0.5], axis=1) * 0.9
    pcm24 = (np.clip(stereo, -1, 1) * (2**23 - 1)).astype("<i4").reshape(-1)
    raw24 = b"".join(int(v).to_bytes(3, "little", signed=True) for v in pcm24)
    res24 = asyncio.run(_transcribe(daemon.wyoming_port, raw24, 48000, 3, 2))
    assert _words(res24["text"]) == _words(SENTENCE)
    x8 = x16[::2]
    res8 = asyncio.run(
        _transcribe(daemon.wyoming_port, (np.clip(x8, -1, 1) * 127).astype(np.int8).tobytes(), 8000, 1, 1)
    )
    assert res8["types"][-2:] == ["transcript", "transcript-stop"]


def test_a_speaker_in_real_time_gets_chunks_while_speaking(daemon):
    x = np.concatenate([speech_samples(SENTENCE), np.zeros(8000, np.float32), speech_samples("what time is it")])
    res = asyncio.run(_transcribe(daemon.wyoming_port, _pcm16(x), 16000, 2, 1, real_time=True))
    assert "transcript-chunk" in res["before_stop"]  # text of the first sentence before the audio ended
    assert _words(res["text"]) == _words(SENTENCE) + _words("what time is it")
    assert _words("".join(res["chunks"])) == _words(res["text"])


def test_four_streams_at_once_lose_nothing(daemon):
    pcm = _pcm16(speech_samples(SENTENCE))

    async def four():
        return await asyncio.gather(*(_transcribe(daemon.wyoming_port, pcm, 16000, 2, 1) for _ in range(4)))

    one = asyncio.run(_transcribe(daemon.wyoming_port, pcm, 16000, 2, 1))
    results = asyncio.run(four())
    assert [r["text"] for r in results] == [one["text"]] * 4


def test_a_transcript_is_handled_by_the_llm_streamed(daemon):
    async def go():
        client = AsyncTcpClient("127.0.0.1", daemon.wyoming_port)
        await client.connect()
        await client.write_event(Transcript(text="what time is it").event())
        events = []
        while True:
            event = await asyncio.wait_for(client.read_event(), 60)
            assert event is not None
            events.append(event)
            if HandledStop.is_type(event.type):
                break
        await client.disconnect()
        return events

    events = asyncio.run(go())
    assert HandledStart.is_type(events[0].type)
    chunks = [HandledChunk.from_event(e).text for e in events if HandledChunk.is_type(e.type)]
    handled = [Handled.from_event(e) for e in events if Handled.is_type(e.type)]
    assert len(handled) == 1 and handled[0].text == "".join(chunks) and chunks


def _raw(port: int, data: bytes, read_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh socket, then read until the server closes it (or ``read_s`` passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        got = b""
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # closed before all of it was read: the point
            return got
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def _event(kind: str, data: dict, payload: bytes = b"") -> bytes:
    import json

    body = json.dumps(data).encode()
    header = {"type": kind, "version": "1.10.2", "data_length": len(body)}
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + body + payload


def _rss_kb(d: Daemon) -> int:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as fh:
        status = fh.read()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


def test_bad_input_closes_only_its_connection(daemon):
    port = daemon.wyoming_port
    pcm = _pcm16(speech_samples(SENTENCE))
    start16 = _event("audio-start", {"rate": 16000, "width": 2, "channels": 1})
    rss_before = _rss_kb(daemon)
    cases = {
        "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a Wyoming event"),
        "odd chunk": (
            start16 + _event("audio-chunk", {"rate": 16000, "width": 2, "channels": 1}, b"\x01\x02\x03"),
            "not whole frames",
        ),
        "rate 0": (_event("audio-start", {"rate": 0, "width": 2, "channels": 1}), "sample rate 0"),
        "huge payload": (b'{"type": "audio-chunk", "payload_length": 999999999999}\n', "payload_length"),
        "chunk first": (
            _event("audio-chunk", {"rate": 16000, "width": 2, "channels": 1}, b"\0\0"),
            "audio-chunk before audio-start",
        ),
    }
    for data, _ in cases.values():
        _raw(port, data)  # returns once the server closed it
    # 10 minutes of audio: closed once it passes max_audio_s, long before all of it is read
    ten_min = start16 + b"".join(
        _event("audio-chunk", {"rate": 16000, "width": 2, "channels": 1}, b"\0\0" * 16000) for _ in range(600)
    )
    _raw(port, ten_min, read_s=60)
    # a client that vanishes mid-stream
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(start16 + _event("audio-chunk", {"rate": 16000, "width": 2, "channels": 1}, pcm[: len(pcm) // 2]))
    # more idle connections than allowed: the excess closed at once, the rest after the idle timeout
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    started = time.monotonic()
    closed = []
    for s in socks:
        s.settimeout(IDLE_S + 10)
        try:
            closed.append(s.recv(1) == b"")
        except TimeoutError:
            closed.append(False)
        s.close()
    assert all(closed) and time.monotonic() - started < IDLE_S + 10
    # the server still serves, and says why it closed each one
    res = asyncio.run(_transcribe(port, pcm, 16000, 2, 1))
    assert _words(res["text"]) == _words(SENTENCE)
    out = daemon.output()
    for name, (_, said) in cases.items():
        assert said in out, (name, said)
    assert f"more than {MAX_AUDIO_S:g} s of audio" in out
    assert "in the middle of a request" in out
    assert f"{MAX_CONNECTIONS} connections are open" in out
    assert f"nothing received for {IDLE_S:g} s" in out
    wait_for(lambda: _rss_kb(daemon) - rss_before < 200_000, 10, what="memory back within 200 MB")
    metrics = urllib.request.urlopen(daemon.url("/metrics"), timeout=10).read().decode()
    assert re.search(r'edge_agent:wyoming_requests_total\{kind="transcribe",outcome="ok"\} [1-9]', metrics)
    assert re.search(r'edge_agent:wyoming_requests_total\{kind="connection",outcome="refused"\} [1-9]', metrics)
