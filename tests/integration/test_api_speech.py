"""Speech through the local API: an uploaded file and a live WebSocket stream of PCM16 give the same
text as the service decoding the same audio directly (the trained demo-asr on ONNX Runtime)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from edge_agent.config import Settings
from edge_agent.serving.asr.tiers import open_speech
from edge_agent.serving.doors.http.server import ApiServer
from tests.speech import require_tools, speech_samples, speech_wav

aiohttp = pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_tools()
    settings = Settings.model_validate(
        {"models": {"asr": [{"name": "ctc", "model": "demo-asr"}], "cache_dir": str(tmp_path_factory.mktemp("m"))}}
    )
    observed = []
    speech = open_speech(settings, observe=observed.append)
    api = ApiServer(None, asr=speech).start("127.0.0.1", 0)
    yield api, speech, observed
    api.stop()
    speech.stop()


def direct_text(speech, samples: np.ndarray, block: int | None = None) -> str:
    stream = speech.service.open_stream()
    for i in range(0, len(samples), block or len(samples)):
        stream.feed(samples[i : i + (block or len(samples))])
    stream.close()
    assert stream.wait(60)
    return " ".join(e.text for e in stream.finals if e.text).strip()


def test_upload_transcribes_like_the_service(served):
    api, speech, observed = served
    wav = speech_wav("set the kitchen light to forty percent")
    boundary = "edgeagentboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            f"Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + wav.read_bytes()
        + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="response_format"\r\n\r\n'
            f"verbose_json\r\n--{boundary}--\r\n"
        ).encode()
    )
    req = urllib.request.Request(
        api.address + "/v1/audio/transcriptions",
        data=body,
        method="POST",
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    assert out["text"] == direct_text(speech, speech_samples("set the kitchen light to forty percent"))
    assert out["segments"] and out["segments"][-1]["final_ms"] >= 0 and out["duration"] > 1.0
    assert observed and "final_ms" in observed[-1].samples and observed[-1].tier == "ctc"
    assert observed[-1].workload == "asr" and not observed[-1].first_after_load


def test_empty_upload_is_a_clear_400(served):
    api, _, _ = served
    boundary = "b"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n\r\n--{boundary}--\r\n'
    ).encode()
    req = urllib.request.Request(
        api.address + "/v1/audio/transcriptions",
        data=body,
        method="POST",
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "empty" in json.loads(err.value.read())["error"]["message"]


def test_websocket_stream_gives_partials_and_the_same_final(served):
    api, speech, _ = served
    samples = speech_samples("turn off all the lights")
    pcm16 = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    pcm = pcm16.tobytes()

    async def talk() -> list[dict]:
        events = []
        ws_url = api.address.replace("http", "ws") + "/v1/audio/stream"
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:
            for i in range(0, len(pcm), 3200):  # 100 ms messages, as a microphone client sends them
                await ws.send_bytes(pcm[i : i + 3200])
            await ws.send_str("end")
            async for msg in ws:
                events.append(json.loads(msg.data))
        return events

    events = asyncio.run(talk())
    finals = [e for e in events if e["kind"] == "final"]
    assert finals, events
    text = " ".join(e["text"] for e in finals if e["text"]).strip()
    assert text and text == direct_text(speech, pcm16.astype(np.float32) / 32768.0, block=1600)
    assert {"speech_start", "final"} <= {e["kind"] for e in events}


def test_a_shedding_speech_tier_refuses_a_websocket_before_the_upgrade(served):
    api, speech, _ = served
    url = api.address.replace("http", "ws") + "/v1/audio/stream"

    async def connect() -> tuple[int, str | None, dict]:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(url):
                    return 101, None, {}
            except aiohttp.WSServerHandshakeError as exc:
                async with session.get(url) as plain:  # the same refusal as a plain request shows its body
                    return exc.status, exc.headers.get("Retry-After"), await plain.json()

    speech.shedding = True
    try:
        status, retry, body = asyncio.run(connect())
    finally:
        speech.shedding = False
    assert status == 503 and retry is not None and int(retry) > 0
    assert body["error"]["code"] == "unavailable" and "shedding" in body["error"]["message"]
    assert asyncio.run(connect())[0] == 101  # serving again once the controller stops shedding


def test_pcm_messages_split_inside_a_sample_lose_nothing():
    from edge_agent.serving.asr.tiers import PcmStream

    fed = []

    class Service:
        def open_stream(self, on_event):
            class Stream:
                feed = staticmethod(fed.append)

            return Stream()

    class Owner:
        service = Service()

        def _observe(self, event):
            pass

    pcm = (np.arange(-500, 500, dtype=np.int16) * 37).astype("<i2").tobytes()
    stream = PcmStream(Owner(), lambda event: None)
    for i in range(0, len(pcm), 333):  # odd sizes: every other message ends inside a sample
        stream.push(pcm[i : i + 333])
    got = np.concatenate(fed)
    np.testing.assert_array_equal(got, np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0)


# -- under load: back-pressure, bounded close, abandoned work dropped (fake engine, real service/API) --


class PacedRecognizer:
    """A recogniser whose step costs ``rtf`` × the audio it takes (or blocks while ``gate`` is clear);
    each stream counts the samples it heard, so a final says whether any audio was lost."""

    kind, name, sample_rate, max_utterance_s = "fake", "paced", 16000, 600.0

    def __init__(self, rtf: float = 0.0) -> None:
        from edge_agent.models.recognizer import AudioStream, Hypothesis

        self._stream_type, self._hyp = AudioStream, Hypothesis
        self.rtf, self.gate = rtf, threading.Event()
        self.gate.set()
        self.taken_s: list[float] = []  # audio each stream step took
        self.stepped: list[int] = []  # id() of every stream stepped

    def new_stream(self):
        stream = self._stream_type(self.sample_rate)
        stream.heard = 0
        return stream

    def step(self, streams):
        self.gate.wait(30)
        out = []
        for s in streams:
            x, ended = s.take()
            self.stepped.append(id(s))
            self.taken_s.append(x.size / self.sample_rate)
            time.sleep(self.rtf * x.size / self.sample_rate)
            s.heard += x.size
            out.append(
                self._hyp(f"heard {s.heard}", (), ended, audio_s=s.heard / self.sample_rate)
                if ended or x.size
                else None
            )
        return out

    def close(self) -> None:
        self.gate.set()


def paced_speech(engine: PacedRecognizer, max_batch: int = 4):
    from edge_agent.serving.asr.batcher import BatchLimits
    from edge_agent.serving.asr.service import AsrService
    from edge_agent.serving.asr.tiers import SpeechTier, TieredSpeech

    # No VAD: each stream is one utterance, from its first sample to its end.
    return TieredSpeech(
        [SpeechTier("paced", lambda: engine)],
        lambda e: AsrService(
            e, limits=BatchLimits(max_batch=max_batch, batch_timeout_ms=0), detector_factory=lambda: None
        ),
    ).start()


def tone(seconds: float) -> bytes:
    n = int(seconds * 16000)
    return (np.sin(np.arange(n) * 0.05) * 8000).astype("<i2").tobytes()


@pytest.mark.slow
def test_a_fast_client_is_held_back_and_loses_nothing():
    from edge_agent.serving.asr.tiers import MAX_BACKLOG_S

    engine = PacedRecognizer(rtf=0.25)  # 4× faster than real time, far slower than the client
    speech = paced_speech(engine)
    api = ApiServer(None, asr=speech).start("127.0.0.1", 0)
    block = tone(0.1)

    async def talk() -> tuple[int, list[dict]]:
        events, sent = [], 0
        ws_url = api.address.replace("http", "ws") + "/v1/audio/stream"
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:
            ws.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # unpaced: as fast as the server takes it
                await asyncio.wait_for(ws.send_bytes(block), 10)
                sent += len(block) // 2
            await ws.send_str("end")
            async for msg in ws:
                events.append(json.loads(msg.data))
        return sent, events

    try:
        sent, events = asyncio.run(asyncio.wait_for(talk(), 60))
    finally:
        api.stop()
        speech.stop(1)
    print(f"sent {sent / 16000:.1f} s; steps took at most {max(engine.taken_s):.2f} s of audio")
    finals = [e for e in events if e["kind"] == "final"]  # (max_utterance_s splits a long stream)
    assert finals and sum(int(e["text"].split()[1]) for e in finals) == sent, events  # every sample decoded
    # the server stopped reading while the stream was behind: no step ever took much more than the bound
    assert max(engine.taken_s) <= MAX_BACKLOG_S + 0.5, max(engine.taken_s)


@pytest.mark.slow
def test_a_stream_the_engine_cannot_serve_gets_overloaded_and_close_1013():
    engine = PacedRecognizer()
    engine.gate.clear()  # the engine stalls on its first step
    speech = paced_speech(engine)
    api = ApiServer(None, asr=speech).start("127.0.0.1", 0)

    async def talk() -> tuple[list[dict], int | None, float]:
        events = []
        ws_url = api.address.replace("http", "ws") + "/v1/audio/stream"
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:
            start = time.monotonic()
            for _ in range(200):  # 20 s of audio, unpaced; the server stops taking it
                if ws.closed:
                    break
                try:
                    await asyncio.wait_for(ws.send_bytes(tone(0.1)), 15)
                except ConnectionError:
                    break
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(msg.data))
            return events, ws.close_code, time.monotonic() - start

    try:
        events, code, took = asyncio.run(asyncio.wait_for(talk(), 60))
    finally:
        engine.gate.set()
        api.stop()
        speech.stop(1)
    assert code == 1013 and took < 20, (code, took)
    assert [e["kind"] for e in events] == ["speech_start", "error", "error"]  # every event has a kind
    assert events[-2]["code"] == "overloaded" and "utterance" in events[-2]  # the utterance's own end
    assert events[-1]["code"] == "overloaded" and "behind" in events[-1]["message"]  # then the stream's


@pytest.mark.slow
def test_close_honours_its_timeout_and_drops_the_streams_queued_work():
    engine = PacedRecognizer()
    speech = paced_speech(engine, max_batch=1)
    try:
        engine.gate.clear()
        busy_events, slow_events = [], []
        busy = speech.open_stream(busy_events.append)
        busy.push(tone(0.4))  # its step takes the device thread and stalls there
        deadline = time.monotonic() + 5
        while not engine.stepped and time.monotonic() < deadline:
            time.sleep(0.005)
        slow = speech.open_stream(slow_events.append)
        slow.push(tone(0.4))  # queued behind it
        slow_rstream = speech.service.batcher._queue[0].item.rstream
        start = time.monotonic()
        slow.close(0.3)
        took = time.monotonic() - start
        assert took < 1.5, took  # was: wait(120) returned at its timeout and the work stayed queued
        assert [e["kind"] for e in slow_events] == ["speech_start", "error"] and slow_events[-1]["code"] == "timeout"
        assert speech.service.batcher.queued == 0 and speech.service.batcher.dropped == 1
        engine.gate.set()
        busy.close(10)
        assert [e["kind"] for e in busy_events][-1] == "final"
        assert id(slow_rstream) not in engine.stepped  # its step never ran
        assert speech.open_streams == {"paced": 0}
    finally:
        engine.gate.set()
        speech.stop(1)


def test_an_abandoned_websocket_drops_its_work_and_frees_its_slot():
    engine = PacedRecognizer()
    engine.gate.clear()
    speech = paced_speech(engine, max_batch=1)
    api = ApiServer(None, asr=speech).start("127.0.0.1", 0)
    url = api.address.replace("http", "ws") + "/v1/audio/stream"

    async def abandon() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(2):  # the first one's step holds the device thread; the second queues
                ws = await session.ws_connect(url)
                await ws.send_bytes(tone(0.4))
                await asyncio.sleep(0.3)
                await ws.close()

    try:
        asyncio.run(asyncio.wait_for(abandon(), 30))
        deadline = time.monotonic() + 5
        while speech.open_streams != {"paced": 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert speech.open_streams == {"paced": 0}  # both released without waiting for the engine
        assert speech.service.batcher.queued == 0 and speech.service.batcher.dropped >= 1
        engine.gate.set()
        deadline = time.monotonic() + 5
        while not engine.stepped and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert len(engine.stepped) == 1  # only the step already running when its client left
    finally:
        engine.gate.set()
        api.stop()
        speech.stop(1)


def test_health_covers_the_speech_workload(served):
    api, speech, _ = served
    with urllib.request.urlopen(api.address + "/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok" and "llm" not in health  # no LLM configured here
    assert health["asr"]["tier"] == speech.active_tier == "ctc"
    assert health["asr"]["model"] == speech.model and health["asr"]["shedding"] is False
    assert health["asr"]["open_streams"] == sum(speech.open_streams.values())
