"""Speech through the local API: an uploaded file and a live WebSocket stream of PCM16 give the same
text as the service decoding the same audio directly (the trained demo-asr on ONNX Runtime)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np
import pytest

from edge_agent.config import Settings
from edge_agent.serving.api import ApiServer
from edge_agent.serving.speech import open_speech
from tests.speech import require_tools, speech_samples, speech_wav

aiohttp = pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_tools()
    settings = Settings.model_validate({"models": {"asr": [{"name": "ctc", "model": "demo-asr"}],
                                                   "cache_dir": str(tmp_path_factory.mktemp("m"))}})
    observed = []
    speech = open_speech(settings, on_utterance=lambda tier, model, samples: observed.append((tier, samples)))
    api = ApiServer(None, asr=speech).start("127.0.0.1", 0)
    yield api, speech, observed
    api.stop()
    speech.stop()


def direct_text(speech, samples: np.ndarray, block: int | None = None) -> str:
    stream = speech.service.open_stream()
    for i in range(0, len(samples), block or len(samples)):
        stream.feed(samples[i:i + (block or len(samples))])
    stream.close()
    assert stream.wait(60)
    return " ".join(e.text for e in stream.finals if e.text).strip()


def test_upload_transcribes_like_the_service(served):
    api, speech, observed = served
    wav = speech_wav("set the kitchen light to forty percent")
    boundary = "edgeagentboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\n").encode() + wav.read_bytes() + (
            f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\n"
            f"verbose_json\r\n--{boundary}--\r\n").encode()
    req = urllib.request.Request(api.address + "/v1/audio/transcriptions", data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    assert out["text"] == direct_text(speech, speech_samples("set the kitchen light to forty percent"))
    assert out["segments"] and out["segments"][-1]["final_ms"] >= 0 and out["duration"] > 1.0
    assert observed and "final_ms" in observed[-1][1] and observed[-1][0] == "ctc"


def test_empty_upload_is_a_clear_400(served):
    api, _, _ = served
    boundary = "b"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n"
            f"\r\n--{boundary}--\r\n").encode()
    req = urllib.request.Request(api.address + "/v1/audio/transcriptions", data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
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
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(api.address.replace("http", "ws") + "/v1/audio/stream") as ws:
                for i in range(0, len(pcm), 3200):  # 100 ms messages, as a microphone client sends them
                    await ws.send_bytes(pcm[i:i + 3200])
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
    from edge_agent.serving.speech import PcmStream

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
        stream.push(pcm[i:i + 333])
    got = np.concatenate(fed)
    np.testing.assert_array_equal(got, np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0)
