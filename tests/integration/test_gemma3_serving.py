"""The real Gemma 3 270M through the agent's serving scheduler: every serving feature keeps the reference's tokens.

Reference: transformers' Gemma3ForCausalLM on the same GGUF (tests/data/gemma3/reference.npz, see
test_gemma3_reference.py). Here the imported folder is served by ``LLMScheduler`` on ONNX Runtime with
continuous batching (four prompts of 7 to 600 tokens at once, max batch 4), chunked prefill (64-token
chunks, so the 600-token prompt crosses the 512-token window in pieces while the others decode), the
prefix cache (the same prompt again: its KV comes from the cache) — greedy tokens must equal the
reference's. Structured output (a tool call constrained by the home tools' schema) is compared with the
other path: jump-forward on and off give the same call, and it validates against the schema.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

REFERENCE = REPO / "tests" / "data" / "gemma3" / "reference.npz"
LABELS = ("water", "capital", "text120", "text600")


@pytest.fixture(scope="module")
def lm(gemma3_model):
    from edge_agent.backends import SessionOptions
    from edge_agent.models.catalog import inspect_folder
    from edge_agent.models.llm import DecoderLM

    model = DecoderLM.open(inspect_folder(gemma3_model), "onnxruntime", SessionOptions(threads=2))
    yield model
    model.close()


def _scheduler(lm, **limits):
    from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

    return LLMScheduler(lm, Limits(**limits)).start()


def _greedy(n: int, **extra):
    from edge_agent.models.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **extra)


def test_batched_chunked_and_cached_requests_keep_the_reference_tokens(lm):
    ref = np.load(REFERENCE)
    scheduler = _scheduler(lm, max_batch=4, batch_timeout_ms=0, prefill_chunk_tokens=64, prefix_cache_mb=256)
    try:
        handles = {label: scheduler.submit(ref[f"{label}_ids"].tolist(), _greedy(40)) for label in LABELS}
        done = {label: h.result(timeout_s=600) for label, h in handles.items()}
        for label in LABELS:
            assert list(done[label].token_ids) == ref[f"{label}_greedy"].tolist(), label
        again = scheduler.submit(ref["text600_ids"].tolist(), _greedy(40)).result(timeout_s=600)
    finally:
        scheduler.stop()
    assert again.timing.cached_tokens >= 512  # the prompt's KV came from the prefix cache, past the window
    assert list(again.token_ids) == ref["text600_greedy"].tolist()


def test_a_constrained_tool_call_is_schema_valid_and_the_same_with_and_without_jump_forward(lm):
    import jsonschema

    from edge_agent.models.grammar import tool_call_grammar, tool_call_schema

    tools = json.loads((REPO / "edge_agent" / "demo_models" / "home-tools.json").read_text())["tools"]
    prompt = (
        "Command: switch off the bedroom light\n"
        'Call: {"name": "set_light", "arguments": {"room": "bedroom", "on": false}}\n'
        "Command: turn on the kitchen light\nCall: "
    )
    ids = lm.tokenizer.encode(prompt)
    calls = []
    for jump in (True, False):
        scheduler = _scheduler(lm, max_batch=1, batch_timeout_ms=0, jump_forward=jump, prefix_cache_mb=0)
        try:
            done = scheduler.submit(ids, _greedy(48, grammar=tool_call_grammar(tools))).result(timeout_s=600)
        finally:
            scheduler.stop()
        calls.append(done.text)
    assert calls[0] == calls[1]
    call = json.loads(calls[0])
    jsonschema.validate(call, tool_call_schema(tools))
