"""OpenAI compatibility gaps found by running llama.cpp's server tests against the local API, each
checked through the official openai client against an in-process ApiServer on the demo models
(demo-phi3 with random weights, the trained demo-asr; ONNX Runtime).

References: a choice of an ``n > 1`` request is the single-choice request with the derived seed
(``seed + index``); the non-streamed shape of a cut-off tool call is the streamed one put together;
``GET /v1/models/{id}`` is the entry of ``GET /v1/models``."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.config import Settings
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.serving.asr.tiers import open_speech
from edge_agent.serving.doors.http.server import ApiServer
from edge_agent.serving.llm.scheduler import Limits
from edge_agent.serving.llm.tiers import Tier, TieredLLM

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
soundfile = pytest.importorskip("soundfile")

ASK = [{"role": "user", "content": "turn on the kitchen lights"}]
TOKEN = "s3cret"
UI = "http://localhost:3000"  # the allowed origin of the CORS tests
RUN = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def ladders(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    ref = resolve_model("demo-phi3", cache)
    tiers = [
        Tier(
            "small",
            lambda: DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1)),
            Limits(max_batch=4, batch_timeout_ms=0),
            200,
        )
    ]
    llm = TieredLLM(tiers).start()
    settings = Settings.model_validate(
        {"models": {"asr": [{"name": "ctc", "model": "demo-asr"}], "cache_dir": str(cache)}}
    )
    speech = open_speech(settings)
    yield llm, speech
    llm.stop()
    speech.stop()


@pytest.fixture(scope="module")
def server(ladders):
    llm, speech = ladders
    api = ApiServer(llm, asr=speech).start("127.0.0.1", 0)
    yield api
    api.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.address + "/v1", api_key="none", max_retries=0)


def _streamed_choices(chunks) -> dict[int, dict]:
    """Per choice index: content, tool call (name, arguments) and finish_reason put back together."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            got = out.setdefault(choice.index, {"content": "", "name": None, "arguments": "", "reason": None})
            delta = getattr(choice, "delta", None)
            if delta is None:  # a completion chunk
                got["content"] += choice.text or ""
            else:
                got["content"] += delta.content or ""
                for call in delta.tool_calls or ():
                    got["name"] = got["name"] if call.function.name is None else call.function.name
                    got["arguments"] += call.function.arguments or ""
            got["reason"] = choice.finish_reason or got["reason"]
    return out


# -- n > 1 ---------------------------------------------------------------------------------------


def test_n_sampled_choices_are_the_single_requests_with_derived_seeds(client):
    kwargs = {"model": "small", "messages": ASK, "temperature": 1.0, "max_tokens": 8}
    out = client.chat.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=7 + i, **kwargs) for i in range(3)]
    assert [c.message.content for c in out.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in out.choices}) > 1  # different seeds drew different text
    # the prompt counted once, every choice's tokens counted
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert all(c.model_extra["timings"]["completion_tokens"] > 0 for c in out.choices)


def test_n_greedy_choices_are_identical(client):
    out = client.chat.completions.create(model="small", messages=ASK, temperature=0, max_tokens=6, n=2)
    one = client.chat.completions.create(model="small", messages=ASK, temperature=0, max_tokens=6)
    assert [c.message.content for c in out.choices] == [one.choices[0].message.content] * 2


def test_n_streamed_choices_carry_their_index_and_match_the_whole_response(client):
    kwargs = {"model": "small", "messages": ASK, "temperature": 1.0, "max_tokens": 8, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**kwargs)
    streamed = _streamed_choices(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        assert streamed[choice.index]["content"] == choice.message.content
        assert streamed[choice.index]["reason"] == choice.finish_reason


def test_n_on_completions(client):
    out = client.completions.create(model="small", prompt="The kitchen", max_tokens=5, temperature=1.0, seed=1, n=2)
    one = client.completions.create(model="small", prompt="The kitchen", max_tokens=5, temperature=1.0, seed=2)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[1].text == one.choices[0].text


def test_n_above_the_bound_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="small", messages=ASK, max_tokens=2, n=9)
    assert err.value.body["param"] == "n"


# -- a tool call cut off by max_tokens -----------------------------------------------------------


def test_a_cut_off_tool_call_has_the_same_shape_streamed_or_not(client):
    cut, named = 0, 0
    for max_tokens in (6, 12, 24, 36, 48, 60):
        kwargs = {
            "model": "small",
            "messages": ASK,
            "tools": [RUN],
            "tool_choice": "required",
            "temperature": 1.0,
            "seed": 5,
            "max_tokens": max_tokens,
        }
        out = client.chat.completions.create(**kwargs)
        choice = out.choices[0]
        streamed = _streamed_choices(client.chat.completions.create(stream=True, **kwargs))[0]
        assert choice.finish_reason == streamed["reason"]
        if choice.finish_reason != "length":
            continue
        cut += 1
        assert choice.message.content is None and streamed["content"] == ""
        (call,) = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == (streamed["name"], streamed["arguments"])
        assert '"name"' not in call.function.arguments  # the arguments alone, never the wrapper
        named += call.function.name == "python"
        # the arguments as far as they were written: a prefix of the wrapper's arguments object (complete
        # JSON only when the cut fell between their last brace and the wrapper's)
        assert not call.function.arguments or call.function.arguments.startswith("{")
    assert cut > named > 0  # budgets cut it in the name and after it, so the comparisons above mean something


# -- models: retrieve, one not-found shape, the whisper-1 alias ----------------------------------


def _wav() -> bytes:
    """A second of quiet noise as a 16 kHz WAV: whatever it transcribes to, every route gets the same."""
    buf = io.BytesIO()
    noise = np.random.default_rng(0).normal(0, 0.01, 16000).astype(np.float32)
    soundfile.write(buf, noise, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_models_retrieve_is_the_lists_entry(client):
    listed = {m.id: m for m in client.models.list()}
    assert {"edge-agent", "small", "ctc", "whisper-1"} <= set(listed)
    for ident in ("edge-agent", "small", "ctc", "whisper-1"):
        assert client.models.retrieve(ident) == listed[ident]
    assert listed["whisper-1"].model_extra["alias_of"] == "ctc"


def test_an_unknown_model_is_the_same_404_on_every_route(client):
    with pytest.raises(openai.NotFoundError) as retrieve:
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as speech:
        client.audio.transcriptions.create(model="gpt-4o-transcribe", file=("a.wav", _wav()))
    for err in (retrieve, chat, speech):
        body = err.value.body
        assert (body["type"], body["code"], body["param"]) == ("invalid_request_error", "model_not_found", "model")
        assert "not served here" in body["message"]


def test_whisper_1_is_the_active_asr_tier_and_the_response_says_so(client):
    wav = _wav()
    direct = client.audio.transcriptions.create(model="ctc", file=("a.wav", wav))
    aliased = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav))
    assert aliased.text == direct.text
    assert "whisper-1" in aliased.model_extra["warnings"][0] and "ctc" in aliased.model_extra["warnings"][0]
    assert not (direct.model_extra or {}).get("warnings")
    raw = client.audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("a.wav", wav), response_format="text"
    )
    assert "whisper-1" in raw.headers["Warning"]


# -- CORS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cors_server(ladders):
    api = ApiServer(ladders[0], token=TOKEN, cors_origins=[UI]).start("127.0.0.1", 0)
    yield api
    api.stop()


def _request(api, method: str, path: str, headers: dict, body: bytes | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(api.address + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def _preflight(api, origin: str) -> tuple[int, dict, bytes]:
    return _request(
        api,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_token(cors_server):
    status, headers, _ = _preflight(cors_server, UI)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == UI and "Origin" in headers["Vary"]
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()


def test_a_preflight_from_another_origin_is_refused_without_cors_headers(cors_server, server):
    for api in (cors_server, server):  # server: no origin configured at all
        status, headers, body = _preflight(api, "http://evil.example")
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        assert json.loads(body)["error"]["code"] == "origin_not_allowed"


def test_responses_to_an_allowed_origin_carry_it(cors_server):
    client = openai.OpenAI(
        base_url=cors_server.address + "/v1", api_key=TOKEN, max_retries=0, default_headers={"Origin": UI}
    )
    raw = client.chat.completions.with_raw_response.create(model="small", messages=ASK, max_tokens=2)
    assert raw.headers["Access-Control-Allow-Origin"] == UI and "Origin" in raw.headers["Vary"]
    assert raw.parse().choices[0].message.content is not None
    with client.chat.completions.with_streaming_response.create(
        model="small", messages=ASK, max_tokens=2, stream=True
    ) as streamed:
        assert streamed.headers["Access-Control-Allow-Origin"] == UI
        assert any(line.startswith("data: [DONE]") for line in streamed.iter_lines())
    # an error is readable by the page too (a wrong token)
    status, headers, _ = _request(cors_server, "GET", "/v1/models", {"Origin": UI})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == UI


def test_responses_to_another_origin_carry_no_cors_headers(cors_server):
    client = openai.OpenAI(
        base_url=cors_server.address + "/v1",
        api_key=TOKEN,
        max_retries=0,
        default_headers={"Origin": "http://evil.example"},
    )
    raw = client.models.with_raw_response.list()
    assert raw.http_response.status_code == 200
    assert not any(h.lower().startswith("access-control-") for h in raw.headers)
