"""Tool-call streaming and the sampling knobs the API maps OpenAI fields to, against plain references."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_agent.models.sampling import Sampler, SamplingParams, logprobs_of
from edge_agent.serving.doors.openai.output import ToolCallStream, split_tool_call, tool_call

CALL = '{"name": "set_light", "arguments": {"room": "kit\\"chen }", "level": 80, "tags": ["warm"]}}'


def _replay(pieces: list[str]) -> tuple[str, str, str]:
    stream = ToolCallStream()
    deltas = [d for p in pieces for d in stream.push(p)] + stream.finish()
    name = "".join(d["tool_calls"][0]["function"].get("name") or "" for d in deltas if "tool_calls" in d)
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if "tool_calls" in d)
    text = "".join(d.get("content", "") for d in deltas)
    return name, args, text


@pytest.mark.parametrize("cut", range(1, len(CALL)))
def test_a_call_split_anywhere_streams_back_to_the_same_call(cut):
    name, args, text = _replay([CALL[:cut], CALL[cut:]])
    want = tool_call(CALL)
    assert want is not None and text == ""
    assert name == want["function"]["name"] == "set_light"
    assert json.loads(args) == json.loads(want["function"]["arguments"])


def test_a_call_streamed_character_by_character_sends_the_name_once():
    stream = ToolCallStream()
    deltas = [d for ch in CALL for d in stream.push(ch)] + stream.finish()
    heads = [d for d in deltas if d["tool_calls"][0].get("id")]
    assert len(heads) == 1 and heads[0]["tool_calls"][0]["function"]["name"] == "set_light"


@pytest.mark.parametrize("answer", ["Sure, the lights are on.", "{not a call"])
def test_words_stream_as_content(answer):
    name, args, text = _replay([answer[:3], answer[3:]])
    assert (name, args, text) == ("", "", answer)
    assert tool_call(answer) is None


@pytest.mark.parametrize("cut", [5, 14, 30, CALL.index("chen }") + 6, len(CALL) - 1])
def test_a_call_cut_off_is_still_a_call_with_what_was_written(cut):
    # only a call starts with "{" in tools mode (the grammar's text branch cannot): a call cut off by
    # max_tokens, even before its name is complete, never leaks the wrapper into content; a "}" it
    # ends on (inside a string here) is part of the arguments, not the wrapper's end
    name, args, text = _replay([CALL[:cut]])
    written = CALL[:cut]
    assert text == "" and "set_light".startswith(name)
    head = '{"name": "set_light", "arguments": '
    assert args == written[len(head) :]  # the unfinished arguments, nothing of the wrapper
    content, call, complete = split_tool_call(written)
    assert content is None and not complete
    assert call is not None and (call["function"]["name"], call["function"]["arguments"]) == (name, args)


def test_frequency_presence_penalties_and_bias_follow_openais_formula():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    generated = [3, 3, 7, 9, 3]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias=((11, 5.0),))
    got = Sampler(p).process(logits, history=[1, 2, *generated], generated=generated)
    want = logits.astype(np.float64).copy()
    want[11] += 5.0
    for token in set(generated):
        want[token] -= generated.count(token) * 0.5 + 0.25
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_mask_leaves_only_allowed_tokens_and_logprobs_renormalise_over_them():
    logits = np.array([3.0, 1.0, 2.0, 0.5], dtype=np.float32)
    allowed = np.array([False, True, True, False])
    row = Sampler(SamplingParams()).process(logits, [], allowed=allowed)
    assert Sampler(SamplingParams()).pick(row) == 2
    lp, top = logprobs_of(row, 2, 4)
    z = np.log(np.exp(1.0) + np.exp(2.0))
    assert lp == pytest.approx(2.0 - z) and [t for t, _ in top] == [2, 1]
    assert top[1][1] == pytest.approx(1.0 - z)


@pytest.mark.parametrize("bad", [{"frequency_penalty": 2.5}, {"logprobs": 21}, {"logit_bias": ((1, 101.0),)}])
def test_out_of_range_knobs_are_refused(bad):
    with pytest.raises(Exception, match="must lie in"):
        SamplingParams(**bad)


def test_a_generated_call_nested_deeper_than_the_parser_reads_is_no_call() -> None:
    # the model writes what the prompt asks; arguments 5,000 arrays deep cannot be read back
    text = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    assert tool_call(text) is None
    assert split_tool_call(text)[2] is False  # not a complete call: its arguments cannot be read
