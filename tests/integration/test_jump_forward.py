"""Jump-forward decoding: the tokens an output format forces go into the cache in one pass with the token
the model picked, instead of one decode step each.

References: a row's logits after a forced run equal those of the whole sequence prefilled at once on a
fresh batch (every KV layout: the plain export's left-padded batch, Gemma-2's sliding window, the in-place
buffers, the NPU plugin's stateful LLM mode); through the scheduler, every token is either one llguidance
forces at that point or the argmax of the reference logits under the format's mask, and the output is
the schema's tool call, in fewer decode steps than tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.grammar import tool_call_grammar, tool_call_schema
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

GENAI_PHI3 = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"
LIGHT = {
    "type": "object",
    "properties": {
        "room": {"enum": ["kitchen", "living room", "hallway"]},
        "on": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["room", "on"],
    "additionalProperties": False,
}
TIMER = {
    "type": "object",
    "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 600}},
    "required": ["minutes"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "set_light", "parameters": LIGHT}},
    {"type": "function", "function": {"name": "set_timer", "parameters": TIMER}},
]


def _open(layout: str, tmp_path: Path) -> DecoderLM:
    if layout == "inplace":
        return DecoderLM.open(inspect_folder(GENAI_PHI3), "onnxruntime", SessionOptions(threads=1))
    if layout == "npu":
        pytest.importorskip("openvino")
        shape = npu.LlmShape(max_prompt=64, min_response=64)
        ref = resolve_model("demo-phi3", tmp_path / "models")
        return DecoderLM.open(ref, "openvino", SessionOptions(device="NPU", extra={"npu_llm": shape}))
    name = {"plain": "demo-phi3", "gemma2": "demo-gemma2"}[layout]
    return DecoderLM.open(resolve_model(name, tmp_path / "models"), "onnxruntime", SessionOptions(threads=1))


@pytest.fixture(params=["plain", "gemma2", "inplace", "npu"])
def pair(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(the model under test, the model whose fresh batches give the references): the same one, except on
    the NPU, whose one KV state a reference would reset, where ONNX Runtime on the same export is it."""
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    model = _open(request.param, tmp_path)
    reference = _open("plain", tmp_path) if request.param == "npu" else model
    yield model, reference
    model.close()
    if reference is not model:
        reference.close()


def _tokens(lm: DecoderLM, n: int, seed: int) -> list[int]:
    high = min(lm.tokenizer.vocab_size, lm.vocab_limit or 10**9)
    return [int(t) for t in np.random.default_rng(seed).integers(3, high, n)]


def _reference(lm: DecoderLM, ids: list[int]) -> np.ndarray:
    """The last logits of ``ids`` prefilled at once on a batch of its own."""
    batch = lm.new_batch(1)
    return lm.join(batch, [object()], [ids])[0]


@pytest.mark.parametrize("rows", [3, 1])
def test_a_forced_run_in_one_pass_gives_the_logits_of_the_whole_sequence(pair, rows: int) -> None:
    lm, reference = pair
    # two steps in which rows take runs of different lengths; a run of 20 goes past Gemma-2's 16-token window
    steps = [[[5], [6, 7, 8, 9], [10, 11]], [[12, 13, 14], [15], list(range(20, 40))]]
    if rows == 1 or lm.max_rows == 1:  # a lone row (the NPU's one sequence): its run in one pass
        rows, steps = 1, [[[6, 7, 8, 9]], [list(range(20, 40))]]
    prompts = [_tokens(lm, n, seed) for seed, n in enumerate((7, 19, 12)[:rows])]
    batch = lm.new_batch(rows)
    lm.join(batch, list(range(rows)), prompts, [len(p) + 40 for p in prompts])
    seen = [list(p) for p in prompts]
    for runs in steps:
        got = lm.decode_runs(batch, runs)
        for i, run in enumerate(runs):
            seen[i] += run
            np.testing.assert_allclose(got[i], _reference(reference, seen[i]), rtol=1e-3, atol=1e-3)
    # and the cache it left takes an ordinary step as well
    got = lm.decode(batch, [3] * rows)
    for i in range(rows):
        np.testing.assert_allclose(got[i], _reference(reference, seen[i] + [3]), rtol=1e-3, atol=1e-3)


def _check_walk(lm: DecoderLM, prompt: list[int], generated: list[int], grammar: str) -> int:
    """Walk ``generated`` with a fresh matcher: each forced run must be what llguidance forces there, each
    other token the argmax of the reference logits under the mask. Returns how many tokens were picked."""
    constraint = lm.token_vocab.constraint(grammar)
    picked, i = 0, 0
    while i < len(generated):
        forced = constraint.forced() if i else []  # the first token is always picked from the prefill's logits
        if forced:
            assert generated[i : i + len(forced)] == forced[: len(generated) - i], f"forced run at token {i}"
            for token in forced[: len(generated) - i]:
                constraint.consume(token)
            i += len(forced)
            continue
        allowed = constraint.allowed()
        logits = _reference(lm, prompt + generated[:i])[: allowed.shape[0]]
        assert generated[i] == int(np.argmax(np.where(allowed, logits, -np.inf))), f"picked token {i}"
        constraint.consume(generated[i])
        picked, i = picked + 1, i + 1
    return picked


def test_a_tool_call_takes_its_forced_tokens_without_a_step_each(pair) -> None:
    lm, reference = pair
    grammar = tool_call_grammar(TOOLS)
    schema = tool_call_schema(TOOLS)
    prompts = [_tokens(lm, 9 + 4 * k, 40 + k) for k in range(3)]
    sched = LLMScheduler(lm, Limits(max_batch=3, batch_timeout_ms=0, prefix_cache_mb=0)).start()
    try:
        handles = [sched.submit(p, SamplingParams(max_new_tokens=80, grammar=grammar)) for p in prompts]
        done = [h.result(120) for h in handles]
        steps = sched.steps
    finally:
        sched.stop()
    picked = 0
    for prompt, d in zip(prompts, done):
        assert d.finish_reason == "stop"
        jsonschema.validate(json.loads(d.text), schema)
        picked += _check_walk(reference, prompt, list(d.token_ids), grammar)
    total = sum(len(d.token_ids) for d in done)
    assert picked < total / 2  # most of a tool call is the format's own text
    assert steps <= picked  # one decode step per picked token at most (the first comes with the prefill)


def test_with_logprobs_or_jump_forward_off_every_token_takes_a_step(tmp_path: Path) -> None:
    model = _open("plain", tmp_path)
    grammar = tool_call_grammar(TOOLS)
    prompt = _tokens(model, 11, 7)
    try:
        for limits, params in (
            (Limits(max_batch=1, batch_timeout_ms=0, jump_forward=False), SamplingParams(max_new_tokens=80)),
            (Limits(max_batch=1, batch_timeout_ms=0), SamplingParams(max_new_tokens=80, logprobs=2)),
        ):
            sched = LLMScheduler(model, limits).start()
            try:
                done = sched.submit(prompt, replace(params, grammar=grammar)).result(120)
                assert sched.steps == len(done.token_ids) - 1  # the first token comes with the prefill
            finally:
                sched.stop()
            json.loads(done.text)
    finally:
        model.close()


def test_admission_learns_a_voice_reply_s_steps_apart_from_a_chat_s(tmp_path: Path) -> None:
    """What admission expects a request to hold its row for is decode steps, one per picked token (its format
    forces the rest), a voice turn's learnt apart from a chat's."""
    import time

    from edge_agent.serving.llm.admission import INTERACTIVE

    model = _open("plain", tmp_path)
    grammar = tool_call_grammar(TOOLS)
    voice_prompt, chat_prompt = _tokens(model, 11, 51), _tokens(model, 9, 52)
    sched = LLMScheduler(model, Limits(max_batch=1, batch_timeout_ms=0, prefix_cache_mb=0)).start()
    try:
        voice = sched.submit(voice_prompt, SamplingParams(max_new_tokens=80, grammar=grammar), tags=(INTERACTIVE,))
        voice = voice.result(120)
        learnt = sched.rates.snapshot(time.monotonic())
        picked = _check_walk(model, voice_prompt, list(voice.token_ids), grammar)
        assert picked < len(voice.token_ids)
        assert learnt.mean_voice_steps == picked and learnt.mean_steps is None
        chat = sched.submit(chat_prompt, SamplingParams(max_new_tokens=80, grammar=grammar)).result(120)
        learnt = sched.rates.snapshot(time.monotonic())
        chat_picked = _check_walk(model, chat_prompt, list(chat.token_ids), grammar)
        assert learnt.mean_steps == chat_picked and learnt.mean_voice_steps == picked
    finally:
        sched.stop()
        model.close()
