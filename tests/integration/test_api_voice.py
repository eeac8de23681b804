"""The speech WebSocket's respond option on a real daemon stack (demo-asr, demo-phi3, espeak-ng speech):
each final is answered by one ``reply`` event whose tool call is the one the chat completions route
gives for the final's text and the same tools (greedy: the same prompt must give the same call); bad
reply settings are a clear error that loses nothing; respond without an LLM is a 503."""

from __future__ import annotations

import asyncio
import json
import logging

import jsonschema
import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.config import Settings
from edge_agent.models.catalog import resolve_model
from edge_agent.models.grammar import tool_call_schema
from edge_agent.models.llm import DecoderLM
from edge_agent.serving.asr.tiers import open_speech
from edge_agent.serving.doors.http.server import ApiServer
from edge_agent.serving.doors.voice.turn import turn_options
from edge_agent.serving.llm.scheduler import Limits
from edge_agent.serving.llm.tiers import Tier, TieredLLM
from tests.speech import require_tools, speech_samples

aiohttp = pytest.importorskip("aiohttp")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_light",
            "parameters": {
                "type": "object",
                "properties": {"room": {"enum": ["kitchen", "hallway"]}, "on": {"type": "boolean"}},
                "required": ["room", "on"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_tools()
    cache = str(tmp_path_factory.mktemp("m"))
    settings = Settings.model_validate({"models": {"asr": [{"name": "ctc", "model": "demo-asr"}], "cache_dir": cache}})
    speech = open_speech(settings)
    ref = resolve_model("demo-phi3", tmp_path_factory.mktemp("models"))
    tier = Tier("small", lambda: DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1)), Limits(), 200)
    llm = TieredLLM([tier]).start()
    api = ApiServer(llm, asr=speech, voice_options=turn_options(settings.audio)).start("127.0.0.1", 0)
    bare = ApiServer(None, asr=speech).start("127.0.0.1", 0)
    yield api, bare
    bare.stop()
    api.stop()
    llm.stop()
    speech.stop()


def pcm(text: str) -> bytes:
    samples = np.concatenate([speech_samples(text), np.zeros(16000, np.float32)])  # a second of silence after
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


async def talk(url: str, audio: bytes, settings: str | None) -> list[dict]:
    events = []
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        if settings is not None:
            await ws.send_str(settings)
        for i in range(0, len(audio), 3200):
            await ws.send_bytes(audio[i : i + 3200])
        await ws.send_str("end")
        async for msg in ws:
            events.append(json.loads(msg.data))
    return events


async def chat_call(base: str, text: str, max_tokens: int = 60) -> dict:
    body = {
        "model": "edge-agent",
        "messages": [{"role": "user", "content": text}],
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    async with aiohttp.ClientSession() as session, session.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        choice = (await resp.json())["choices"][0]
        return {**choice["message"]["tool_calls"][0]["function"], "finish_reason": choice["finish_reason"]}


def test_each_final_gets_the_call_the_chat_route_gives_for_its_text(served):
    api, _ = served
    url = api.address.replace("http", "ws") + "/v1/audio/stream?respond=true"
    settings = json.dumps({"tools": TOOLS, "max_tokens": 60})
    events = asyncio.run(talk(url, pcm("turn on the kitchen lights") + pcm("switch off the hallway light"), settings))
    finals = [e for e in events if e["kind"] == "final" and e["text"]]
    replies = [e for e in events if e["kind"] == "reply"]
    assert finals and [r["utterance"] for r in replies] == [f["utterance"] for f in finals], events
    for final, reply in zip(finals, replies):
        assert events.index(reply) > events.index(final)
        (call,) = reply["tool_calls"]
        jsonschema.validate(
            {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])},
            tool_call_schema(TOOLS),
        )
        want = asyncio.run(chat_call(api.address, final["text"]))
        assert call["function"]["name"] == want["name"]
        assert json.loads(call["function"]["arguments"]) == json.loads(want["arguments"])
        assert reply["finish_reason"] == want["finish_reason"] == "tool_calls"
        assert reply["complete_ms"] is not None and reply["complete_ms"] >= reply["first_token_ms"]


def test_a_call_cut_short_by_max_tokens_has_the_chat_route_s_shape(served):
    api, _ = served
    url = api.address.replace("http", "ws") + "/v1/audio/stream?respond=true"
    events = asyncio.run(talk(url, pcm("turn on the kitchen lights"), json.dumps({"tools": TOOLS, "max_tokens": 9})))
    finals = [e for e in events if e["kind"] == "final" and e["text"]]
    (reply,) = [e for e in events if e["kind"] == "reply"]
    want = asyncio.run(chat_call(api.address, finals[-1]["text"], max_tokens=9))
    (call,) = reply["tool_calls"]
    assert reply["finish_reason"] == want["finish_reason"] == "length"
    assert (call["function"]["name"], call["function"]["arguments"]) == (want["name"], want["arguments"])


def test_bad_reply_settings_are_an_error_and_the_stream_goes_on(served):
    api, _ = served
    url = api.address.replace("http", "ws") + "/v1/audio/stream?respond=true"
    events = asyncio.run(talk(url, pcm("turn on the kitchen lights"), '{"tools": [{"type": "function"}]}'))
    errors = [e for e in events if e["kind"] == "error"]
    assert errors and errors[0]["code"] == "bad_message" and "tools[0]" in errors[0]["message"]
    finals = [e for e in events if e["kind"] == "final" and e["text"]]
    replies = [e for e in events if e["kind"] == "reply"]
    assert finals and len(replies) == len(finals)  # words replies: the settings stayed the defaults
    assert all(r["tool_calls"] is None for r in replies)


def test_respond_needs_an_llm_and_a_yes_or_no(served):
    api, bare = served

    async def status(base: str, query: str) -> int:
        url = base.replace("http", "ws") + "/v1/audio/stream" + query
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(url):
                    return 101
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    assert asyncio.run(status(bare.address, "?respond=true")) == 503
    assert asyncio.run(status(api.address, "?respond=maybe")) == 400
    assert asyncio.run(status(api.address, "?respond=false")) == 101


@pytest.mark.parametrize(
    "settings",
    [
        '{"tools": ' + "[" * 5000 + "]" * 5000 + "}",  # 10 KB, deeper than the JSON parser's stack
        '{"max_tokens": ' + "9" * 5000 + "}",  # an integer longer than Python reads
    ],
    ids=["nested-5000", "long-integer"],
)
def test_unreadable_reply_settings_are_a_bad_message_and_the_stream_goes_on(served, settings, caplog):
    api, _ = served
    url = api.address.replace("http", "ws") + "/v1/audio/stream?respond=true"
    with caplog.at_level(logging.DEBUG):
        events = asyncio.run(talk(url, pcm("turn on the kitchen lights"), settings))
    errors = [e for e in events if e["kind"] == "error"]
    assert [e["code"] for e in errors] == ["bad_message"], events
    finals = [e for e in events if e["kind"] == "final" and e["text"]]
    replies = [e for e in events if e["kind"] == "reply"]
    assert finals and len(replies) == len(finals)  # transcribed and answered: the stream went on
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
