"""Chunked prefill on real exports: a long prompt enters over several loop turns, with the running
streams' decode steps between its chunks, and still yields the tokens of a whole prefill.

Both cache layouts: demo-phi3's plain export (each chunk extends the prompt's own batch-1 past,
which joins the left-padded batch after the last chunk) and its onnxruntime-genai folder
(GroupQueryAttention: chunks are written in place into the prompt's reserved slot).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.bench.prefill import format_report, main
from edge_agent.errors import DeadlineExceeded, EdgeAgentError
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.kv_slots import SlotCache
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

GENAI_PHI3 = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"
CHUNK = 32


@pytest.fixture(scope="module", params=["plain", "genai"])
def lm(request, tmp_path_factory):
    ref = resolve_model("demo-phi3", tmp_path_factory.mktemp("m")) if request.param == "plain" else None
    model = DecoderLM.open(ref or inspect_folder(GENAI_PHI3), "onnxruntime", SessionOptions(threads=1))
    assert isinstance(model.new_batch(1), SlotCache) == (request.param == "genai")
    yield model
    model.close()


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 990, size=n).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def limits(chunk: int) -> Limits:
    return Limits(max_batch=4, batch_timeout_ms=0, prefill_chunk_tokens=chunk)


class ChunkSpy:
    """Counts ``prefill_chunk`` calls per row; ``on_chunk(seq, k)`` runs before the k-th (1-based) of a row."""

    def __init__(self, lm: DecoderLM, on_chunk=None) -> None:
        self.lm, self.real, self.on_chunk = lm, lm.prefill_chunk, on_chunk
        self.calls: dict[int, int] = {}

    def __call__(self, batch, state, n):
        k = self.calls[state.row.handle.id] = self.calls.get(state.row.handle.id, 0) + 1
        if self.on_chunk is not None:
            self.on_chunk(state.row, k)
        return self.real(batch, state, n)

    def __enter__(self) -> ChunkSpy:
        self.lm.prefill_chunk = self
        return self

    def __exit__(self, *exc) -> None:
        del self.lm.prefill_chunk


def run_with_a_stream(lm: DecoderLM, chunk: int, long_prompts: list[list[int]], new_tokens: int = 12):
    """A short stream decodes; once it has tokens, the long prompts arrive. Returns the stream's and
    the long requests' handles (all finished) and the stream's token times."""
    sched = LLMScheduler(lm, limits(chunk)).start()
    try:
        stream = sched.submit(prompt(5, 99), greedy(300))
        events = iter(stream)
        for _ in range(3):
            next(events)
        longs = [sched.submit(p, greedy(new_tokens)) for p in long_prompts]
        times = [e.time_s for e in events]
    finally:
        sched.stop()
    return stream, longs, times


def test_chunked_prompts_get_the_tokens_of_a_whole_prefill_and_of_generate_greedy(lm):
    long_prompts = [prompt(7 * CHUNK + 5, 1), prompt(CHUNK // 2, 2), prompt(4 * CHUNK, 3)]
    expected = [list(lm.generate_greedy(p, 12, stop_at_eos=False)) for p in long_prompts]
    with ChunkSpy(lm) as spy:
        stream, longs, _ = run_with_a_stream(lm, CHUNK, long_prompts)
    assert max(spy.calls.values()) >= 8  # the first long prompt really went in chunks
    whole_stream, whole, _ = run_with_a_stream(lm, 0, long_prompts)
    for handle, ref, off in zip(longs, expected, whole):
        assert list(handle.result(1).token_ids) == ref == list(off.result(1).token_ids)
    assert stream.result(1).token_ids == whole_stream.result(1).token_ids  # the stream is untouched too
    timing = longs[0].result().timing
    assert timing.queue_ms is not None and timing.prefill_ms is not None and timing.prefill_ms > 0
    assert timing.ttft_ms == pytest.approx(timing.queue_ms + timing.prefill_ms)


@pytest.mark.parametrize("chunk", [CHUNK, 0])
def test_a_running_stream_keeps_getting_tokens_while_a_long_prompt_is_prefilled(lm, chunk):
    """The stream's tokens between the long request's start (its first chunk) and its first token:
    with chunking, one per decode step between chunks; with whole prefill, none."""
    stream, (long_,), times = run_with_a_stream(lm, chunk, [prompt(10 * CHUNK, 4)], new_tokens=2)
    timing = long_.result(1).timing
    assert timing.scheduled_s is not None
    between = [t for t in times if timing.scheduled_s < t < timing.token_times_s[0]]
    if chunk:
        assert len(between) >= 9  # a decode step after each of its first 9 chunks
    else:
        assert between == []
    assert stream.result(1).finish_reason == "length"


@pytest.mark.parametrize("fault", ["cancel", "deadline", "error"])
def test_a_request_that_ends_mid_prefill_frees_its_cache_and_only_it_fails(lm, fault):
    sched = LLMScheduler(lm, limits(CHUNK)).start()
    seen_load = []
    long_id = {}

    def on_chunk(seq, k):
        if seq.handle.id != long_id.get("id") or k != 3:
            return
        seen_load.append(sched.load)
        if fault == "cancel":
            seq.handle.cancel()
        elif fault == "deadline":
            time.sleep(0.3)  # past its 200 ms deadline before the next turn
        else:
            raise EdgeAgentError("injected chunk failure")

    long_prompt = prompt(8 * CHUNK, 5)
    try:
        with ChunkSpy(lm, on_chunk):
            stream = sched.submit(prompt(5, 99), greedy(60))
            events = iter(stream)
            next(events)
            long_id["id"] = sched._next_id + 1
            long_ = sched.submit(long_prompt, greedy(4), deadline_ms=200 if fault == "deadline" else None)
            assert long_.id == long_id["id"]
            if fault == "cancel":
                done = long_.result(10)
                assert done.finish_reason == "cancelled" and done.token_ids == ()
            else:
                with pytest.raises(DeadlineExceeded if fault == "deadline" else EdgeAgentError):
                    long_.result(10)
            assert seen_load == [(0, 2)]  # the prefilling request counted as running
            after = sched.submit(long_prompt, greedy(4))  # its slot (or cache) is free for the next one
            assert list(after.result(10).token_ids) == list(lm.generate_greedy(long_prompt, 4, stop_at_eos=False))
            assert stream.result(10).finish_reason == "length"
        assert sched.load == (0, 0)
        if isinstance(sched._batch, SlotCache):
            assert sched._batch.pending is None
    finally:
        sched.stop()


def test_stop_drains_a_prompt_being_prefilled_in_chunks(lm):
    sched = LLMScheduler(lm, limits(CHUNK)).start()
    stream = sched.submit(prompt(5, 99), greedy(20))
    next(iter(stream))
    long_prompt = prompt(6 * CHUNK, 6)
    long_ = sched.submit(long_prompt, greedy(5))
    sched.stop()
    assert list(long_.result(1).token_ids) == list(lm.generate_greedy(long_prompt, 5, stop_at_eos=False))
    assert len(stream.result(1).token_ids) == 20


def test_bench_prefill_reports_both_settings_and_ratios_of_their_medians(tmp_path):
    out = tmp_path / "prefill.json"
    args = ["--model", "demo-phi3", "--cache-dir", str(tmp_path), "--rounds", "2", "--streams", "2"]
    assert main([*args, "--long-prompt-tokens", "256", "--chunk", "32", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for name in ("whole", "chunked"):
        assert len(report["rounds"][name]) == 2
        ttfts = [r["long_ttft_ms"] for r in report["rounds"][name]]
        assert report["medians"][name]["long_ttft_ms"] == pytest.approx(statistics.median(ttfts))
    m = report["medians"]
    assert report["ratios"]["itl_p99_ms"] == pytest.approx(m["chunked"]["itl_p99_ms"] / m["whole"]["itl_p99_ms"])
    assert "chunked/whole" in format_report(report)


@pytest.mark.parametrize("together", [False, True])
def test_prompts_admitted_together_stream_their_first_tokens_one_prefill_apart(lm, together):
    """Three prompts admitted in one turn: one by one, each one's first token is delivered before the
    next prompt's prefill runs; ``prefill_together`` batches a plain export's prompts in one prefill (the
    in-place slots prefill one by one either way). The tokens are generate_greedy's in every case."""
    prompts = [prompt(40, 11), prompt(25, 12), prompt(60, 13)]
    expected = [list(lm.generate_greedy(p, 6, stop_at_eos=False)) for p in prompts]
    # preferred size 3 on an idle engine: the three wait for each other and are admitted in the same turn
    sched = LLMScheduler(
        lm,
        Limits(
            max_batch=4, batch_timeout_ms=5_000, preferred_batch_sizes=(3,), adaptive=False, prefill_together=together
        ),
    )
    events: list[tuple] = []
    real_join, real_deliver = lm.join, sched._deliver

    def join(batch, rows, prompts_, reach=None):
        events.append(("join", tuple(r.handle.id for r in rows)))
        return real_join(batch, rows, prompts_, reach)

    def deliver(seq, token, final, logprob=None, now=None):
        if len(seq.generated) == 1:
            events.append(("first", seq.handle.id))
        return real_deliver(seq, token, final, logprob, now)

    lm.join, sched._deliver = join, deliver
    try:
        sched.start()
        handles = [sched.submit(p, greedy(6)) for p in prompts]
        results = [list(h.result(30).token_ids) for h in handles]
    finally:
        sched.stop()
        del lm.join
    assert results == expected
    a, b, c = (h.id for h in handles)
    if together and not isinstance(lm.new_batch(1), SlotCache):
        assert events == [("join", (a, b, c)), ("first", a), ("first", b), ("first", c)]
    else:
        assert events == [("join", (a,)), ("first", a), ("join", (b,)), ("first", b), ("join", (c,)), ("first", c)]


def test_warming_every_slot_leaves_the_cache_empty_and_the_answers_unchanged(lm):
    """The scheduler warms each in-place slot at load; what it ran there must not leak into requests."""
    batch = lm.new_batch(3)
    lm.warm_slots(batch)
    assert len(batch) == 0
    prompts = [prompt(30, 21), prompt(9, 22), prompt(50, 23)]
    first = lm.join(batch, ["a", "b", "c"], prompts)  # every slot taken again, by real prompts
    steps = [[int(t) for t in np.argmax(first, axis=-1)]]
    for _ in range(3):  # decode steps read the slots' whole past: a left-over would show here
        steps.append([int(t) for t in np.argmax(lm.decode(batch, steps[-1]), axis=-1)])
    assert [list(col) for col in zip(*steps)] == [list(lm.generate_greedy(p, 4, stop_at_eos=False)) for p in prompts]
