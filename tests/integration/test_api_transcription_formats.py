"""``POST /v1/audio/transcriptions`` through the official openai client, in every ``response_format``, on
the trained demo-asr (ONNX Runtime) behind a real in-process ApiServer.

References: the text is the service decoding the same samples directly; the duration is the WAV's
length as soundfile reads it; segment times are checked against where the test put silence (digital
zeros, where no utterance can be voiced); SubRip and WebVTT are parsed by a small parser here."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile

import numpy as np
import pytest

from edge_agent.config import Settings
from edge_agent.serving.asr.tiers import open_speech
from edge_agent.serving.doors.http.server import ApiServer
from tests.speech import require_tools, speech_samples

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
soundfile = pytest.importorskip("soundfile")

RATE = 16000
FIRST, SECOND = "turn on the kitchen light", "set a timer for ten minutes"
LEAD_S, GAP_S, TAIL_S = 0.4, 1.5, 0.8
FRAME_S = 0.02  # the endpointer's frame: a voiced frame may straddle the edge of a silence by this much


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_tools()
    settings = Settings.model_validate(
        {"models": {"asr": [{"name": "ctc", "model": "demo-asr"}], "cache_dir": str(tmp_path_factory.mktemp("m"))}}
    )
    speech = open_speech(settings)
    api = ApiServer(None, asr=speech).start("127.0.0.1", 0)
    yield api, speech
    api.stop()
    speech.stop()


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    """Two sentences with silence before, between and after, as a 16-bit WAV; the silent spans."""
    require_tools()
    a = speech_samples(FIRST, lead_s=0.0, tail_s=0.0)
    b = speech_samples(SECOND, lead_s=0.0, tail_s=0.0)
    silence = [np.zeros(int(s * RATE), np.float32) for s in (LEAD_S, GAP_S, TAIL_S)]
    samples = np.concatenate([silence[0], a, silence[1], b, silence[2]])
    path = tmp_path_factory.mktemp("wav") / "two.wav"
    soundfile.write(path, samples, RATE, subtype="PCM_16")
    gap = ((LEAD_S * RATE + a.size) / RATE, (LEAD_S * RATE + a.size + GAP_S * RATE) / RATE)
    return path, gap


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].address + "/v1", api_key="unused", max_retries=0)


def direct_text(speech, path) -> str:
    samples, rate = soundfile.read(str(path), dtype="float32")
    assert rate == RATE
    stream = speech.service.open_stream()
    stream.feed(samples)
    stream.close()
    assert stream.wait(60)
    return " ".join(e.text for e in sorted(stream.finals, key=lambda e: e.utterance) if e.text).strip()


def wav_duration(path) -> float:
    info = soundfile.info(str(path))
    return info.frames / info.samplerate


def transcribe(client, path, **kw):
    with open(path, "rb") as f:
        return client.audio.transcriptions.create(file=f, **kw)


_TIME = r"(\d{2}):(\d{2}):(\d{2})SEP(\d{3})"


def _seconds(match: tuple[str, str, str, str]) -> float:
    h, m, s, ms = (int(x) for x in match)
    return h * 3600 + m * 60 + s + ms / 1000


def parse_cues(body: str, sep: str) -> list[tuple[float, float, str]]:
    """Cues of a SubRip (``sep`` ",", numbered) or WebVTT (``sep`` ".") body: (start, end, text)."""
    stamp = _TIME.replace("SEP", re.escape(sep))
    timing = re.compile(rf"^{stamp} --> {stamp}$")
    cues = []
    blocks = [b for b in body.strip("\n").split("\n\n") if b.strip()]
    for n, block in enumerate(blocks, 1):
        lines = block.split("\n")
        if sep == ",":
            assert lines[0] == str(n), f"cue {n} is numbered {lines[0]!r}"
            lines = lines[1:]
        m = timing.match(lines[0])
        assert m, f"cue {n}: bad timing line {lines[0]!r}"
        groups = m.groups()
        text = "\n".join(lines[1:])
        assert text.strip(), f"cue {n} has no text"
        cues.append((_seconds(groups[:4]), _seconds(groups[4:]), text))
    return cues


def check_times(spans: list[tuple[float, float]], duration: float, gap: tuple[float, float]) -> None:
    """Monotonic, non-overlapping, inside the file; none voiced inside the test's silences."""
    previous_end = 0.0
    for start, end in spans:
        assert previous_end <= start < end <= duration + 1e-3, spans
        previous_end = end
    assert spans[0][0] >= LEAD_S - FRAME_S, spans  # nothing is voiced in the leading zeros
    assert spans[-1][1] <= duration - TAIL_S + FRAME_S, spans  # nor in the trailing ones
    for start, end in spans:  # and no utterance runs through the gap between the sentences
        assert end <= gap[0] + FRAME_S or start >= gap[1] - FRAME_S, (spans, gap)
    assert any(end <= gap[0] + FRAME_S for _, end in spans) and any(start >= gap[1] - FRAME_S for start, _ in spans)


def test_json_is_the_text_and_text_is_plain(served, client, audio):
    _, speech = served
    path, _ = audio
    reference = direct_text(speech, path)
    assert reference
    out = transcribe(client, path, model="edge-agent")
    assert out.text == reference
    with open(path, "rb") as f:
        raw = client.audio.transcriptions.with_raw_response.create(file=f, model="edge-agent")
    assert raw.http_response.json() == {"text": reference}
    plain = transcribe(client, path, model="ctc", response_format="text")
    assert plain == reference + "\n"


def test_verbose_json_has_openais_shape_and_the_files_timing(served, client, audio):
    _, speech = served
    path, gap = audio
    out = transcribe(
        client, path, model="edge-agent", response_format="verbose_json", timestamp_granularities=["segment"]
    )
    assert out.task == "transcribe" and out.language == "en"
    assert out.duration == pytest.approx(wav_duration(path), abs=1e-6)
    assert out.text == direct_text(speech, path)
    segments = out.segments
    assert segments and [s.id for s in segments] == list(range(len(segments)))
    assert " ".join(s.text for s in segments) == out.text
    assert all(isinstance(s.start, float) and isinstance(s.end, float) for s in segments)
    check_times([(s.start, s.end) for s in segments], out.duration, gap)


@pytest.mark.parametrize("fmt, sep", [("srt", ","), ("vtt", ".")])
def test_srt_and_vtt_are_cue_files_of_the_segments(served, client, audio, fmt, sep):
    path, gap = audio
    body = transcribe(client, path, model="edge-agent", response_format=fmt)
    assert isinstance(body, str)
    if fmt == "vtt":
        assert body.startswith("WEBVTT\n\n")
        body = body[len("WEBVTT\n\n") :]
    cues = parse_cues(body, sep)
    text = transcribe(client, path, model="edge-agent").text
    assert " ".join(c[2] for c in cues) == text
    check_times([(c[0], c[1]) for c in cues], wav_duration(path), gap)


def _refused(client, path, param: str, *fragments: str, **kw) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        transcribe(client, path, **kw)
    assert err.value.status_code == 400
    body = err.value.body
    body = body.get("error", body) if isinstance(body, dict) else json.loads(err.value.response.text)["error"]
    assert body["param"] == param, body
    for fragment in fragments:
        assert fragment in body["message"], body


@pytest.mark.parametrize(
    "kw, param, fragments",
    [
        ({"response_format": "tsv"}, "response_format", ("'tsv'", "json, text, srt, vtt, verbose_json")),
        ({"language": "fr"}, "language", ("'fr'", "'en'")),
        (
            {"timestamp_granularities": ["word"], "response_format": "verbose_json"},
            "timestamp_granularities",
            ("word",),
        ),
        ({"timestamp_granularities": ["segment"]}, "timestamp_granularities", ("verbose_json",)),
        ({"prompt": "kitchen lights"}, "prompt", ("prompt",)),
        ({"temperature": 0.4}, "temperature", ("0.4",)),
        ({"stream": True}, "stream", ("/v1/audio/stream",)),
        ({"extra_body": {"chunking_strategy": "auto"}}, "chunking_strategy", ("'chunking_strategy'",)),
    ],
    ids=["format", "language", "word-times", "times-in-json", "prompt", "temperature", "stream", "unknown"],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(client, audio, kw, param, fragments):
    kw = {"model": "edge-agent", **kw}
    if kw.get("stream"):
        with pytest.raises(openai.BadRequestError) as err, open(audio[0], "rb") as f:
            client.audio.transcriptions.create(file=f, **kw)
        assert err.value.status_code == 400 and "/v1/audio/stream" in str(err.value)
        return
    _refused(client, audio[0], param, *fragments, **kw)


def test_fields_that_are_honoured(client, audio):
    path, _ = audio
    text = transcribe(client, path, model="edge-agent").text
    assert transcribe(client, path, model="ctc", language="en", temperature=0.0, prompt="").text == text


def test_a_bad_upload_names_its_file_not_a_server_path(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model="edge-agent", file=("meeting-notes.wav", b"this is not audio"))
    message = str(err.value)
    assert "meeting-notes.wav" in message
    assert tempfile.gettempdir() not in message and "/tmp" not in message, message


def test_stream_errors_use_kind_like_every_other_event(served):
    aiohttp = pytest.importorskip("aiohttp")
    api, _ = served

    async def talk() -> list[dict]:
        url = api.address.replace("http", "ws") + "/v1/audio/stream"
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            await ws.send_str("hello")
            first = json.loads((await ws.receive(timeout=10)).data)
            await ws.send_str("end")
            return [first] + [json.loads(m.data) async for m in ws]

    events = asyncio.run(talk())
    assert events[0]["kind"] == "error" and "type" not in events[0]
    assert events[0]["code"] and "PCM16" in events[0]["message"]
    assert all("kind" in e and "type" not in e for e in events)
