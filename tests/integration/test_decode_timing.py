"""The gate's decode timing runs through the scheduler's own calls, so an in-place KV folder is timed
with its in-place buffers (not a growing cache it would never use when served)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.backends import SessionOptions
from edge_agent.engines.decode_timing import decode_ms_per_token
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.kv_slots import SlotCache
from edge_agent.models.llm import DecoderLM

GENAI = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"


@pytest.mark.parametrize("form", ["plain", "genai"])
def test_decode_timing_steps_through_new_batch_join_and_decode(form, tmp_path):
    ref = inspect_folder(GENAI) if form == "genai" else resolve_model("demo-phi3", tmp_path)
    lm = DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1))
    calls, batches = [], []
    decode, new_batch = lm.decode, lm.new_batch
    lm.decode = lambda batch, tokens: (calls.append(len(tokens)), decode(batch, tokens))[1]  # type: ignore[method-assign]
    lm.new_batch = lambda rows: (batches.append(b := new_batch(rows)), b)[1]  # type: ignore[method-assign]
    try:
        ms = decode_ms_per_token(lm, [5, 6, 7, 8], new_tokens=6)
    finally:
        lm.close()
    assert ms > 0 and calls == [1] * 6
    assert isinstance(batches[0], SlotCache) == (form == "genai")
