"""The shipped home-commands adapter on the real Gemma 3 270M (slow): merged as ``models fetch
gemma-3-270m-home`` merges it, the model answers a spoken-style command through the agent's own voice-turn
request with a call that its tool's schema takes. (How often the call is the right one is measured by
``edge-agent bench calls``, on the real model, not asserted here.)

Fast: the shipped adapter's files are what its record says (sha256) and fit Gemma 3 270M's layers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REPO

SHAPES = {  # Gemma 3 270M: hidden 640, 4 query heads and 1 KV head of 256, FFN 2048 ([out, in])
    "self_attn.q_proj": (1024, 640),
    "self_attn.k_proj": (256, 640),
    "self_attn.v_proj": (256, 640),
    "self_attn.o_proj": (640, 1024),
    "mlp.gate_proj": (2048, 640),
    "mlp.up_proj": (2048, 640),
    "mlp.down_proj": (640, 2048),
}


def test_the_shipped_adapter_is_intact_and_fits_gemma_3_270m():
    from edge_agent.importers.adapter import ADAPTERS
    from edge_agent.importers.fetch import FETCHABLE
    from edge_agent.importers.staging import sha256_file

    adapter = ADAPTERS["gemma-3-270m-home"]
    meta = json.loads((adapter.folder / "adapter.json").read_text())
    assert sha256_file(adapter.folder / "adapter.npz") == meta["sha256"]
    assert meta["base"]["sha256"] == FETCHABLE[adapter.base].files[0].sha256
    rank = meta["rank"]
    with np.load(adapter.folder / "adapter.npz") as z:
        names = set(z.files)
        assert len(names) == 18 * len(SHAPES) * 2
        for layer in range(18):
            for module, (out, inp) in SHAPES.items():
                assert z[f"model.layers.{layer}.{module}.lora_A"].shape == (rank, inp)
                assert z[f"model.layers.{layer}.{module}.lora_B"].shape == (out, rank)


@pytest.mark.slow
def test_the_merged_model_answers_a_command_with_a_schema_valid_call(gemma3_model, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from edge_agent.backends import SessionOptions
    from edge_agent.importers.adapter import ADAPTERS, merge
    from edge_agent.models.catalog import inspect_folder
    from edge_agent.models.grammar import tool_call_schema
    from edge_agent.models.llm import DecoderLM
    from edge_agent.models.sampling import SamplingParams
    from edge_agent.serving.doors.voice.turn import VoiceTurn, chat_submit
    from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

    merged = merge(ADAPTERS["gemma-3-270m-home"], gemma3_model, tmp_path / "gemma-3-270m-home").path
    tools = json.loads((REPO / "edge_agent" / "demo_models" / "home-tools.json").read_text())["tools"]
    lm = DecoderLM.open(inspect_folder(merged), "onnxruntime", SessionOptions(threads=2))
    scheduler = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        turn = VoiceTurn(chat_submit(scheduler, lm.tokenizer), tools, tool_choice="auto", tick_s=None)
        params = SamplingParams(max_new_tokens=64, temperature=0.0, grammar=turn.grammar)
        done = chat_submit(scheduler, lm.tokenizer)(turn.chat("switch on the bathroom light"), params).result(120.0)
        turn.close()
    finally:
        scheduler.stop()
        lm.close()
    call = VoiceTurn.call_of(done.text)
    assert call is not None, done.text
    jsonschema.validate(call, tool_call_schema(tools))
    assert call["name"] == "set_light"
