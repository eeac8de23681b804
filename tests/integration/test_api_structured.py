"""Structured output, tool calls, logprobs, timings and strict fields through the official openai
client, on a real demo model with random weights (ONNX Runtime): whatever the weights say, the
output follows the requested format. References: ``jsonschema`` for validity, the bare model's logits
(numpy log-softmax) for logprobs, the daemon's own per-request observation for timings."""

from __future__ import annotations

import json
import time
import urllib.request

import jsonschema
import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.tokenizer import Message
from edge_agent.serving.doors.http.server import ApiServer
from edge_agent.serving.llm.scheduler import Limits
from edge_agent.serving.llm.tiers import Tier, TieredLLM

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

LIGHT = {
    "type": "object",
    "properties": {
        "room": {"type": "string", "maxLength": 12},
        "level": {"type": "integer", "minimum": 0, "maximum": 100},
        "on": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["warm", "cold"]}, "maxItems": 2},
    },
    "required": ["room", "level", "on"],
    "additionalProperties": False,
}
MUSIC = {
    "type": "object",
    "properties": {"artist": {"type": "string", "maxLength": 16}, "volume": {"type": "number"}},
    "required": ["artist"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "set_light", "description": "Switch a light", "parameters": LIGHT}},
    {"type": "function", "function": {"name": "play_music", "parameters": MUSIC}},
]
SCHEMAS = {"set_light": LIGHT, "play_music": MUSIC}
ASK = [{"role": "user", "content": "turn on the kitchen lights"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ref = resolve_model("demo-phi3", tmp_path_factory.mktemp("models"))
    seen = []
    tiers = [
        Tier(
            "small",
            lambda: DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1)),
            Limits(max_batch=4, batch_timeout_ms=0),
            200,
        )
    ]
    llm = TieredLLM(tiers, observe=seen.append).start()
    api = ApiServer(llm).start("127.0.0.1", 0)
    reference = DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1))
    yield api, seen, reference
    api.stop()
    llm.stop()
    reference.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0].address + "/v1", api_key="none", max_retries=0)


def _streamed(chunks) -> tuple[str, dict | None, str]:
    """(content, tool call as {name, arguments}, finish_reason) put back together from chunks."""
    text, name, args, reason = "", None, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            text += delta.content or ""
            for call in delta.tool_calls or ():
                name = call.function.name or name
                args += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return text, ({"name": name, "arguments": args} if name else None), reason


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_always_validates_whatever_the_random_weights_say(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "light", "schema": LIGHT, "strict": True}}
    out = client.chat.completions.create(
        model="small", messages=ASK, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), LIGHT)
    text, _, reason = _streamed(
        client.chat.completions.create(
            model="small", messages=ASK, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200, stream=True
        )
    )
    assert reason == "stop" and text == out.choices[0].message.content  # same seed, same tokens


@pytest.mark.parametrize("seed", range(4))
def test_json_object_output_is_a_json_object(client, seed):
    out = client.chat.completions.create(
        model="small", messages=ASK, response_format={"type": "json_object"}, temperature=0.7, seed=seed
    )
    if out.choices[0].finish_reason == "stop":  # a free-form object may run past max_tokens: that says "length"
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].finish_reason == "length" and out.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("seed", range(6))
def test_required_tool_calls_name_a_declared_tool_with_valid_arguments(client, seed):
    out = client.chat.completions.create(
        model="small", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    _, streamed, reason = _streamed(
        client.chat.completions.create(
            model="small",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            stream=True,
        )
    )
    assert reason == "tool_calls" and streamed is not None
    assert streamed["name"] == call.function.name
    assert json.loads(streamed["arguments"]) == json.loads(call.function.arguments)


def test_a_named_tool_choice_calls_that_tool(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model="small",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "play_music"}},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "play_music"
        jsonschema.validate(json.loads(call.function.arguments), MUSIC)


def test_auto_tool_choice_is_either_words_or_a_valid_call(client):
    for seed in range(4):
        out = client.chat.completions.create(
            model="small", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=40
        )
        message = out.choices[0].message
        if message.tool_calls:
            assert out.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(
                json.loads(message.tool_calls[0].function.arguments), SCHEMAS[message.tool_calls[0].function.name]
            )
        else:
            assert message.content and not message.content.startswith("{")


def test_a_conversation_with_tool_results_is_accepted(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "set_light", "arguments": '{"room": "kitchen", "level": 80, "on": true}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    out = client.chat.completions.create(model="small", messages=messages, tools=TOOLS, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logprobs_are_the_models_own_log_softmax(server, client):
    _, _, reference = server
    out = client.chat.completions.create(
        model="small", messages=ASK, temperature=0, max_tokens=3, logprobs=True, top_logprobs=5
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    tok = reference.tokenizer
    ids = tok.encode_chat([Message("user", ASK[0]["content"])])
    logits, _, _ = reference.prefill([ids])
    row = logits[0, : tok.id_limit].astype(np.float64)  # ids the tokenizer cannot decode are never offered
    want = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    first = content[0]
    assert first.logprob == pytest.approx(want.max(), abs=1e-4)  # greedy: the most likely token
    tops = [t.logprob for t in first.top_logprobs]
    assert len(tops) == 5 and tops == sorted(tops, reverse=True)
    assert tops == pytest.approx(np.sort(want)[::-1][:5].tolist(), abs=1e-4)
    assert first.top_logprobs[0].token == first.token and bytes(first.bytes) == first.token.encode()


def test_completion_logprobs_have_the_legacy_shape(client):
    out = client.completions.create(model="small", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_timings_are_the_daemons_own_figures_for_that_request(server, client):
    _, seen, _ = server
    raw = client.chat.completions.with_raw_response.create(model="small", messages=ASK, max_tokens=6, temperature=0)
    out = raw.parse()
    t = out.model_extra["timings"]
    deadline = time.monotonic() + 5  # the observation is delivered just after the response is finished
    while not (obs := [o for o in list(seen) if abs(o.samples["e2e_ms"][0] - t["e2e_ms"]) < 0.01]):
        assert time.monotonic() < deadline, "no observation of this request"
        time.sleep(0.01)
    obs = obs[-1]
    assert (obs.tokens_in, obs.tokens_out) == (t["prompt_tokens"], t["completion_tokens"])
    assert [t["ttft_ms"]] == pytest.approx(obs.samples["ttft_ms"], abs=1e-2)  # what the metrics recorded
    assert [t["e2e_ms"]] == pytest.approx(obs.samples["e2e_ms"], abs=1e-2)
    assert t["queue_ms"] + t["prefill_ms"] == pytest.approx(t["ttft_ms"], abs=0.01)
    assert t["completion_tokens"] == out.usage.completion_tokens and t["tier"] == out.model == "small"
    header = raw.headers["server-timing"]
    assert f"ttft;dur={t['ttft_ms']}" in header and f"e2e;dur={t['e2e_ms']}" in header
    chunks = list(client.chat.completions.create(model="small", messages=ASK, max_tokens=4, temperature=0, stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["timings"]["completion_tokens"] == 4 or last.choices[0].finish_reason == "stop"
    off = client.chat.completions.create(model="small", messages=ASK, max_tokens=2, extra_body={"timings": False})
    assert "timings" not in (off.model_extra or {})


def _reference_greedy(reference: DecoderLM, ids: list[int], n: int, freq: float, presence: float) -> list[int]:
    """Greedy decoding with OpenAI's penalties, written out with the bare model and numpy."""
    mask = np.ones((1, len(ids)), dtype=np.int64)
    logits, past = reference.forward(np.asarray([ids], dtype=np.int64), mask, reference._empty_past(1))
    out: list[int] = []
    known = reference.tokenizer.id_limit  # the agent never picks an id its tokenizer cannot decode
    for _ in range(n):
        row = logits[0, -1, :known].astype(np.float64)
        for token in set(out):
            row[token] -= out.count(token) * freq + presence
        token = int(np.argmax(row))
        out.append(token)
        if token in reference.contract.eos_ids:
            break
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        logits, past = reference.forward(np.asarray([[token]], dtype=np.int64), mask, past)
    return out


def test_logit_bias_and_penalties_are_honoured(server, client):
    _, _, reference = server
    out = client.chat.completions.create(
        model="small", messages=ASK, max_tokens=1, temperature=0, logit_bias={"7": 100}, logprobs=True
    )
    first = out.choices[0].logprobs.content[0]
    assert bytes(first.bytes) == reference.token_vocab.token_bytes(7)  # +100 on id 7: it is picked
    assert first.logprob == pytest.approx(0.0, abs=1e-3)  # ... with certainty
    penalised = client.chat.completions.create(
        model="small", messages=ASK, max_tokens=12, temperature=0, frequency_penalty=1.5, presence_penalty=0.5
    )
    ids = reference.tokenizer.encode_chat([Message("user", ASK[0]["content"])])
    want = _reference_greedy(reference, ids, 12, 1.5, 0.5)
    assert penalised.choices[0].message.content == reference.tokenizer.decode(want)
    plain = _reference_greedy(reference, ids, 12, 0.0, 0.0)
    assert want != plain  # the penalties changed something, so the comparison above means something


def test_max_tokens_above_the_cap_is_clamped_and_the_response_says_so(client):
    out = client.chat.completions.create(model="small", messages=ASK, max_tokens=100000, temperature=0)
    assert out.usage.completion_tokens <= 200
    assert out.model_extra["timings"]["max_tokens"] == {"requested": 100000, "granted": 200}
    assert "100000" in out.model_extra["warnings"][0]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 9}, "n"),
        ({"store": True}, "store"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"stream_options": {"include_usage": True, "colour": 1}}, "stream_options"),
    ],
)
def test_fields_the_agent_cannot_honour_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="small", messages=ASK, max_tokens=2, extra_body=extra)
    body = err.value.body
    assert body["param"].startswith(param) and param in body["message"]


def test_a_schema_llguidance_cannot_use_is_a_400_naming_response_format(server):
    api = server[0]
    body = {
        "messages": ASK,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
    }
    req = urllib.request.Request(
        api.address + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert "response_format" in json.loads(err.value.read())["error"]["message"]


def test_completion_echo_returns_the_prompt_then_the_same_completion(client):
    plain = client.completions.create(model="small", prompt="Once upon", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="small", prompt="Once upon", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    streamed = client.completions.create(
        model="small", prompt="Once upon", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_streamed_logprobs_match_the_whole_response(client):
    whole = client.chat.completions.create(
        model="small", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    chunks = client.chat.completions.create(
        model="small", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    want = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in want]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in want], abs=1e-5)
