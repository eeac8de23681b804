"""The prefix KV cache on the demo models: greedy tokens with the cache equal those without it (DecoderLM's
own generate_greedy, or the scheduler with the cache off), on the plain-export layout and the in-place one,
with an output format and with chunked prefill; the cache stays within its bound; a request whose cached
blocks are evicted while it runs keeps its tokens; a stateful model runs without it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.grammar import json_schema_grammar
from edge_agent.models.kv_batch import DecodeBatch
from edge_agent.models.kv_slots import SlotCache
from edge_agent.models.llm import DecoderLM
from edge_agent.models.prefix_cache import PrefixCache
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.prefill import Prefills
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

GENAI_PHI3 = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"
BLOCK = 16


@pytest.fixture(scope="module", params=["plain", "inplace"])
def lm(request, tmp_path_factory):
    ref = resolve_model("demo-phi3", tmp_path_factory.mktemp("m")) if request.param == "plain" else None
    model = DecoderLM.open(ref or inspect_folder(GENAI_PHI3), "onnxruntime", SessionOptions(threads=1))
    assert isinstance(model.new_batch(1), SlotCache) == (request.param == "inplace")
    yield model
    model.close()


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 990, size=n).tolist()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def limits(chunk: int = 0, mb: float = 64.0) -> Limits:
    return Limits(max_batch=4, batch_timeout_ms=0, prefill_chunk_tokens=chunk, prefix_cache_mb=mb)


def test_a_prompt_that_shares_a_prefix_gets_it_from_the_cache_and_the_tokens_of_a_whole_prefill(lm):
    system = tokens(5 * BLOCK + 3, 1)
    prompts = [system + tokens(9, 2), system + tokens(20, 3), system + tokens(9, 2), system[:40]]
    expected = [list(lm.generate_greedy(p, 12, stop_at_eos=False)) for p in prompts]
    sched = LLMScheduler(lm, limits()).start()
    try:
        done = [sched.submit(p, greedy(12)).result(60) for p in prompts]  # one after another: each sees the last
    finally:
        sched.stop()
    assert [list(d.token_ids) for d in done] == expected
    whole = (len(system) // BLOCK) * BLOCK
    # the first prefilled everything; the second and third took the system prompt's whole blocks (the
    # third its own last whole block too), the fourth the blocks of its 40 tokens it shares
    assert [d.timing.cached_tokens for d in done] == [0, whole, ((len(prompts[2]) - 1) // BLOCK) * BLOCK, 32]
    stats = sched.prefix_stats
    assert stats is not None and stats.lookups == 4 and stats.hit_tokens == sum(d.timing.cached_tokens for d in done)


def test_with_an_output_format_the_tokens_are_those_without_the_cache(lm):
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}, "n": {"type": "integer"}}}
    system = tokens(3 * BLOCK, 4)
    prompts = [system + tokens(7, 5), system + tokens(11, 6)]

    def run(mb: float) -> list:
        sched = LLMScheduler(lm, limits(mb=mb)).start()
        try:
            params = SamplingParams(max_new_tokens=30, grammar=json_schema_grammar(schema))
            return [sched.submit(p, params).result(60) for p in prompts]
        finally:
            sched.stop()

    off, on = run(0), run(64)
    assert [d.token_ids for d in on] == [d.token_ids for d in off]
    assert on[1].timing.cached_tokens == 3 * BLOCK and off[1].timing.cached_tokens == 0
    for d in on:
        json.loads(d.text)  # still a complete value of the format


class DecodeGate:
    """Holds the model's decode steps until ``open()``, so what is submitted after a stream's first token is
    admitted while the stream decodes, and so prefilled in chunks (as in test_chunked_prefill)."""

    def __init__(self, lm: DecoderLM) -> None:
        self.lm, self.real, self.go = lm, lm.decode, threading.Event()

    def __call__(self, batch, toks):
        assert self.go.wait(30), "the test never opened the decode gate"
        return self.real(batch, toks)

    def __enter__(self) -> DecodeGate:
        self.lm.decode = self
        return self

    def __exit__(self, *exc) -> None:
        self.go.set()
        del self.lm.decode


def test_a_hit_whose_rest_is_prefilled_in_chunks_gets_the_tokens_of_a_whole_prefill(lm):
    system = tokens(6 * BLOCK, 7)
    long = system + tokens(5 * BLOCK + 7, 8)  # the rest goes in chunks of 16 while a stream decodes
    expected = list(lm.generate_greedy(long, 12, stop_at_eos=False))
    chunks: list[int] = []
    real = lm.prefill_chunk

    def spy(batch, state, n):
        chunks.append(state.done)
        return real(batch, state, n)

    sched = LLMScheduler(lm, limits(chunk=BLOCK))
    with DecodeGate(lm) as gate:
        sched.start()
        lm.prefill_chunk = spy
        try:
            assert sched.submit(system + tokens(3, 9), greedy(1)).result(60)  # into the cache; no decode step
            stream = sched.submit(tokens(5, 99), greedy(40))
            events = iter(stream)
            next(events)  # from its prefill; its first decode step waits at the gate
            chunks.clear()
            handle = sched.submit(long, greedy(12))
            gate.go.set()
            done = handle.result(60)
            list(events)
        finally:
            gate.go.set()
            del lm.prefill_chunk
            sched.stop()
    assert list(done.token_ids) == expected
    assert done.timing.cached_tokens == len(system)
    assert chunks[0] == len(system) and len(chunks) >= 5  # started after the cached blocks, then in chunks


def test_the_cache_never_holds_more_than_its_bound(lm):
    mb = 0.25  # demo-phi3: 2 layers x 2 x 4 heads x 16 dims x 4 bytes = 1 KiB a token: 256 tokens fit
    sched = LLMScheduler(lm, limits(mb=mb)).start()
    seen = []
    try:
        for seed in range(12):
            sched.submit(tokens(100, 100 + seed), greedy(1)).result(60)
            stats = sched.prefix_stats
            assert stats is not None
            seen.append(stats.bytes)
            assert stats.bytes <= stats.max_bytes == int(mb * 2**20)
    finally:
        sched.stop()
    assert stats.evictions > 0 and max(seen) > stats.max_bytes // 2  # it filled up and evicted


@pytest.mark.parametrize("together", [False, True])
def test_evicting_the_blocks_a_running_request_came_from_leaves_its_tokens_alone(lm, together):
    """Driven step by step on this thread: a hit joins the batch, every cached block is evicted and
    overwritten by other prompts while it decodes, and its tokens stay those of a whole prefill."""
    system = tokens(4 * BLOCK, 10)
    prompt = system + tokens(5, 11)
    expected = list(lm.generate_greedy(prompt, 10, stop_at_eos=False))
    cache = PrefixCache(64 * 2**20, BLOCK)
    prefills: Prefills[str] = Prefills(lm, 0, together, cache)
    batch = lm.new_batch(4)
    got: list[int] = []

    def joined(first, logits):
        got.append(int(logits[0].argmax()))

    prefills.add(["warm"], [system + tokens(2, 12)], [None])
    assert prefills.plan(0)[0][3] == 0
    prefills.run(batch, 0, lambda *_: None)
    batch.remove([0])
    prefills.add(["hit"], [prompt], [None])
    assert prefills.plan(0) == [("hit", True, True, len(system))]
    assert prefills.run(batch, 0, joined) == []
    row = batch.rows.index("hit")
    cache.clear()  # every block it came from is gone ...
    filler = [system[:BLOCK] + tokens(3 * BLOCK, 13 + k) for k in range(2)]
    prefills.add(["f0", "f1"], filler, [None, None])  # ... and others take their place, in the same batch
    while len(prefills):
        prefills.plan(1)
        assert prefills.run(batch, 1, lambda *_: None) == []
    assert cache.stats.evictions > 0 and len(batch) == 3
    while len(got) < 10:
        logits = lm.decode(batch, [got[-1] if r == "hit" else 5 for r in batch.rows])
        got.append(int(logits[row].argmax()))
    assert got == expected
    assert isinstance(batch, DecodeBatch | SlotCache)


def test_a_stateful_model_runs_without_the_cache(caplog):
    from edge_agent.models.kv_state import StatefulBatch

    class Stateful:
        max_rows = StatefulBatch.max_rows
        ref = type("Ref", (), {"name": "npu-llm"})()

    from edge_agent.serving.llm.scheduler import _prefix_cache

    with caplog.at_level("INFO", logger="edge_agent.serving.llm.scheduler"):
        assert _prefix_cache(Stateful(), limits()) is None  # type: ignore[arg-type]
    assert "no prefix cache" in caplog.text and "stateful" in caplog.text


@pytest.mark.parametrize("layout", ["plain", "inplace"])
def test_a_sliding_window_model_gets_the_tokens_of_a_whole_prefill(layout, tmp_path):
    """Gemma-2's window of 16 is shorter than the cached prefix: the rest's attention must still see only it."""
    from edge_agent.engines.inplace_kv import convert_inplace

    ref = resolve_model("demo-gemma2", tmp_path)
    if layout == "inplace":
        convert_inplace(ref.path, tmp_path / "inplace", check_tokens=0)
        ref = inspect_folder(tmp_path / "inplace", name="demo-gemma2")
    model = DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1))
    try:
        system = tokens(4 * BLOCK + 6, 20)
        prompts = [system + tokens(k, 21 + k) for k in (5, 9, 30)]
        expected = [list(model.generate_greedy(p, 20, stop_at_eos=False)) for p in prompts]
        sched = LLMScheduler(model, limits()).start()
        try:
            done = [sched.submit(p, greedy(20)).result(60) for p in prompts]
        finally:
            sched.stop()
        assert [list(d.token_ids) for d in done] == expected
        assert [d.timing.cached_tokens for d in done] == [0, 4 * BLOCK, 4 * BLOCK]
    finally:
        model.close()
