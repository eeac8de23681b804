"""Speech streams under load, against a real ``edge-agent run`` with the demo-asr tier: WebSocket
clients that push PCM16 much faster than real time must still get a ``final`` or an ``error`` for
every ``speech_start``, the session must end promptly after ``end``, and abandoned streams must not
leave work behind that delays the next stream or upload."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import numpy as np
import pytest

from tests.daemon_proc import Daemon, speech_daemon
from tests.mqtt_broker import Broker
from tests.speech import require_tools, speech_samples, speech_wav

aiohttp = pytest.importorskip("aiohttp")

SENTENCES = ("turn on the kitchen light", "set the timer for ten minutes", "what is the weather tomorrow")
CLIENTS = 4
PUSH_S = 10.0  # each client pushes for this long, as fast as the server reads
SESSION_BOUND_S = 30.0  # "end" → the server closes the socket, every event delivered
PROMPT_S = 10.0  # a normal stream's final and an upload's answer after the overload


def _pcm(text: str) -> bytes:
    return (np.clip(speech_samples(text), -1, 1) * 32767).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    require_tools()
    tmp = tmp_path_factory.mktemp("speech-faults")
    broker = Broker(tmp).start()
    d = speech_daemon(tmp, broker.port)
    try:
        d.start(timeout_s=240)
        yield d
    finally:
        out = d.close()
        broker.stop()
        print(out[-4000:])


def _ws_url(d: Daemon) -> str:
    return d.url("/v1/audio/stream").replace("http", "ws")


async def _fast_client(session, url: str, pcm: bytes, push_s: float, graceful: bool, pace: float | None = None) -> dict:
    """Push ``pcm`` over and over for ``push_s``, unpaced or at ``pace`` × real time; then ``end`` and
    read until the server closes (graceful), or just drop the connection (abandon)."""
    events: list[dict] = []
    out = {"events": events, "pushed_s": 0.0, "session_s": None, "close_code": None}
    async with session.ws_connect(url, heartbeat=None) as ws:
        # a small send buffer, so that what this client has "sent" is what the server has taken in,
        # not minutes of audio parked in the kernel (Linux grows it up to tcp_wmem's maximum)
        ws.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)

        async def read() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(msg.data))

        reader = asyncio.create_task(read())
        start = time.monotonic()
        deadline = start + push_s
        sent, i = 0, 0
        while time.monotonic() < deadline and not reader.done():
            chunk = pcm[i : i + 3200] or pcm[:3200]
            i = (i + 3200) % len(pcm)
            # a server applying back-pressure stops reading; a send may then wait, but boundedly
            await asyncio.wait_for(ws.send_bytes(chunk), 20.0)
            sent += len(chunk)
            if pace is not None:
                await asyncio.sleep(max(0.0, start + sent / 32000 / pace - time.monotonic()))
        out["pushed_s"] = sent / 32000
        if not graceful:
            reader.cancel()
            return out
        ended = time.monotonic()
        if not reader.done():
            await ws.send_str("end")
        try:
            await asyncio.wait_for(reader, SESSION_BOUND_S)
            out["session_s"] = time.monotonic() - ended
        except asyncio.TimeoutError:
            pass
        out["close_code"] = ws.close_code
    return out


def _unanswered(events: list[dict]) -> list[int]:
    started = [e["utterance"] for e in events if e.get("kind") == "speech_start"]
    ended = {e["utterance"] for e in events if e.get("kind") in ("final", "error")}
    return [u for u in started if u not in ended]


async def _upload(session, url: str, wav: bytes) -> tuple[float, dict]:
    form = aiohttp.FormData()
    form.add_field("file", wav, filename="a.wav", content_type="audio/wav")
    form.add_field("response_format", "verbose_json")
    start = time.monotonic()
    async with session.post(url, data=form, timeout=aiohttp.ClientTimeout(total=60)) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    return time.monotonic() - start, body


async def _normal_stream(session, url: str, pcm: bytes) -> tuple[float, list[dict]]:
    """A microphone-like client: 100 ms messages at real time, then ``end``; seconds from end to final."""
    events: list[dict] = []
    async with session.ws_connect(url) as ws:
        for i in range(0, len(pcm), 3200):
            await ws.send_bytes(pcm[i : i + 3200])
            await asyncio.sleep(0.1)
        await ws.send_str("end")
        ended = time.monotonic()

        async def read() -> None:
            async for msg in ws:
                events.append(json.loads(msg.data))
                if events[-1].get("kind") == "final":
                    return

        try:
            await asyncio.wait_for(read(), 60)
        except asyncio.TimeoutError:
            pass
    return time.monotonic() - ended, events


@pytest.mark.parametrize("pace", [None, 3.0], ids=["unpaced", "3x-real-time"])
def test_fast_streams_keep_their_finals_and_abandoned_work_is_dropped(daemon, pace):
    pcm = b"".join(_pcm(s) for s in SENTENCES)
    one = _pcm("switch off the fan")
    wav = speech_wav("open the garage door").read_bytes()
    url = _ws_url(daemon)

    async def scenario() -> dict:
        async with aiohttp.ClientSession() as session:
            graceful = await asyncio.gather(
                *(_fast_client(session, url, pcm, PUSH_S, True, pace) for _ in range(CLIENTS))
            )
            abandoned = await asyncio.gather(*(_fast_client(session, url, pcm, 4.0, False) for _ in range(CLIENTS)))
            normal, upload = await asyncio.gather(
                _normal_stream(session, url, one), _upload(session, daemon.url("/v1/audio/transcriptions"), wav)
            )
        return {"graceful": graceful, "abandoned": abandoned, "normal": normal, "upload": upload}

    got = asyncio.run(asyncio.wait_for(scenario(), 300))
    for n, c in enumerate(got["graceful"]):
        kinds = [e.get("kind") for e in c["events"]]
        print(
            f"client {n}: pushed {c['pushed_s']:.0f} s of audio; speech_start {kinds.count('speech_start')}, "
            f"final {kinds.count('final')}, error {kinds.count('error')}, session {c['session_s']} s, "
            f"close {c['close_code']}"
        )
    normal_s, normal_events = got["normal"]
    upload_s, upload_body = got["upload"]
    print(
        f"after the abandoned streams: normal stream final {normal_s:.2f} s after end, upload {upload_s:.2f} s "
        f"({upload_body})"
    )

    for c in got["graceful"]:
        kinds = [e.get("kind") for e in c["events"]]
        assert kinds.count("speech_start") >= 2, c["events"][:5]  # the load did reach the recogniser
        assert not _unanswered(c["events"]), f"speech_start without final or error: {_unanswered(c['events'])}"
        assert c["session_s"] is not None and c["session_s"] < SESSION_BOUND_S
        assert c["close_code"] == 1000
        # back-pressure, not errors: a client that pushes too fast is slowed down, and loses nothing
        assert kinds.count("error") == 0 and kinds.count("final") == kinds.count("speech_start")
    finals = [e for e in normal_events if e.get("kind") == "final"]
    assert finals and finals[0]["text"], normal_events
    assert normal_s < PROMPT_S
    assert upload_s < PROMPT_S and upload_body["text"]
    assert upload_body["segments"] and all(seg["kind"] == "final" for seg in upload_body["segments"])
    # a client that left is routine: no handler traceback for events it can no longer receive
    assert "Error handling request" not in daemon.output()
