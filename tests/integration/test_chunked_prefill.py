"""Chunked prefill on real exports: a long prompt enters over several loop turns, with the running
streams' decode steps between its chunks, and still yields the tokens of a whole prefill.

Both cache layouts: demo-phi3's plain export (each chunk extends the prompt's own batch-1 past,
which joins the left-padded batch after the last chunk) and its onnxruntime-genai folder
(GroupQueryAttention: chunks are written in place into the prompt's reserved slot).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.bench.prefill import format_report
from edge_agent.cli import main
from edge_agent.errors import DeadlineExceeded, EdgeAgentError, Unavailable
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.kv_slots import SlotCache
from edge_agent.models.llm import ChunkedPrefill, DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.handle import RequestHandle
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
    """Counts ``prefill_chunk`` calls per prompt being prefilled (its ``ChunkedPrefill``) and keeps the
    batch they fill; ``on_chunk(state, k)`` runs before the k-th (1-based) chunk of ``state.prompt``."""

    def __init__(self, lm: DecoderLM, on_chunk=None) -> None:
        self.lm, self.real, self.on_chunk = lm, lm.prefill_chunk, on_chunk
        self.calls: dict[ChunkedPrefill, int] = {}
        self.batch = None

    def __call__(self, batch, state, n):
        k = self.calls[state] = self.calls.get(state, 0) + 1
        self.batch = batch
        if self.on_chunk is not None:
            self.on_chunk(state, k)
        return self.real(batch, state, n)

    def __enter__(self) -> ChunkSpy:
        self.lm.prefill_chunk = self
        return self

    def __exit__(self, *exc) -> None:
        del self.lm.prefill_chunk


class DecodeGate:
    """Holds the model's decode steps until ``open()``. A stream submitted behind the gate stops after
    the token its prefill gives, so what the test submits next is queued while the stream still has
    every decode step to run: it is admitted while the stream decodes, and so prefilled in chunks,
    however fast a decode step is and however late the test thread runs. Install it after the
    scheduler is built (building it warms the slots with a decode step). The wait is bounded only as
    a safety net."""

    def __init__(self, lm: DecoderLM) -> None:
        self.lm, self.real, self.go = lm, lm.decode, threading.Event()

    def __call__(self, batch, tokens):
        assert self.go.wait(30), "the test never opened the decode gate"
        return self.real(batch, tokens)

    def open(self) -> None:
        self.go.set()

    def __enter__(self) -> DecodeGate:
        self.lm.decode = self
        return self

    def __exit__(self, *exc) -> None:
        self.go.set()
        del self.lm.decode


class FakeClock:
    """The scheduler's clock, moved only by the test (admission never waits: ``batch_timeout_ms`` 0)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_with_a_stream(lm: DecoderLM, chunk: int, long_prompts: list[list[int]], new_tokens: int = 12):
    """A short stream decodes; the long prompts arrive after its first token and before its second
    (``DecodeGate``), so they are prefilled while it streams. Returns the stream's and the long
    requests' handles (all finished) and the times of the stream's tokens after its first."""
    sched = LLMScheduler(lm, limits(chunk))
    with DecodeGate(lm) as gate:
        sched.start()
        try:
            stream = sched.submit(prompt(5, 99), greedy(300))
            events = iter(stream)
            next(events)  # from its prefill; its first decode step waits at the gate
            longs = [sched.submit(p, greedy(new_tokens)) for p in long_prompts]
            gate.open()
            times = [e.time_s for e in events]
        finally:
            gate.open()
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
    """A long prompt queued behind a stream's first token (``DecodeGate``) is prefilled in chunks between
    the stream's steps; before its third chunk it is cancelled, passes its deadline, or its chunk fails."""
    long_prompt = prompt(8 * CHUNK, 5)
    expected = list(lm.generate_greedy(long_prompt, 4, stop_at_eos=False))
    clock = FakeClock()  # the deadline passes when the test says so, not when the machine is slow
    sched = LLMScheduler(lm, limits(CHUNK), clock=clock)
    held: dict[str, RequestHandle] = {}
    injected = []  # (chunk, the scheduler's load) where the fault struck

    def on_chunk(state, k):
        if state.prompt != long_prompt or k != 3 or injected:  # the first request of long_prompt only
            return
        injected.append((k, sched.load))
        if fault == "cancel":
            held["long"].cancel()
        elif fault == "deadline":
            clock.now += 0.3  # past its 200 ms deadline before the next turn
        else:
            raise EdgeAgentError("injected chunk failure")

    try:
        with ChunkSpy(lm, on_chunk) as spy, DecodeGate(lm) as gate:
            sched.start()
            stream = sched.submit(prompt(5, 99), greedy(60))
            next(iter(stream))  # its first decode step waits at the gate
            held["long"] = long_ = sched.submit(
                long_prompt, greedy(4), deadline_ms=200 if fault == "deadline" else None
            )
            gate.open()
            if fault == "cancel":
                done = long_.result(10)
                assert done.finish_reason == "cancelled" and done.token_ids == ()
            else:
                with pytest.raises(DeadlineExceeded if fault == "deadline" else EdgeAgentError):
                    long_.result(10)
            assert injected == [(3, (0, 2))], "the fault never struck the long prompt's third chunk"  # it ran
            after = sched.submit(long_prompt, greedy(4))  # its slot (or cache) is free for the next one
            assert list(after.result(10).token_ids) == expected
            assert stream.result(10).finish_reason == "length"
        assert sched.load == (0, 0)
        if isinstance(spy.batch, SlotCache):
            assert spy.batch.pending is None
    finally:
        sched.stop()


def wait_until_stopping(sched: LLMScheduler, timeout_s: float = 30.0) -> bool:
    """True once ``stop()`` has begun, which ``submit`` shows by refusing (each probe it takes before
    then is cancelled at once, and dropped unstarted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sched.submit(prompt(3, 7), greedy(1)).cancel()
        except Unavailable:
            return True
        time.sleep(0.001)
    return False


def test_stop_drains_a_prompt_being_prefilled_in_chunks(lm):
    """``stop()`` while a long prompt is part-way through its chunks: its second chunk waits until
    ``stop()`` has begun, and then it and the stream still complete."""
    long_prompt = prompt(6 * CHUNK, 6)
    expected = list(lm.generate_greedy(long_prompt, 5, stop_at_eos=False))
    sched = LLMScheduler(lm, limits(CHUNK))
    mid_prefill = threading.Event()
    chunks, stopping = [], []

    def on_chunk(state, k):
        if state.prompt != long_prompt:
            return
        chunks.append(k)
        if k == 2:
            mid_prefill.set()
            stopping.append(wait_until_stopping(sched))

    with ChunkSpy(lm, on_chunk), DecodeGate(lm) as gate:
        sched.start()
        try:
            stream = sched.submit(prompt(5, 99), greedy(20))
            next(iter(stream))  # its first decode step waits at the gate
            long_ = sched.submit(long_prompt, greedy(5))
            gate.open()
            assert mid_prefill.wait(30), "the long prompt never reached its second chunk"
        finally:
            gate.open()
            sched.stop()
    assert stopping == [True]  # stop() began between its first and its last chunk
    assert chunks == [1, 2, 3, 4, 5, 6]
    assert list(long_.result(1).token_ids) == expected
    assert len(stream.result(1).token_ids) == 20


def test_bench_prefill_reports_both_settings_and_ratios_of_their_medians(tmp_path):
    out = tmp_path / "prefill.json"
    args = ["bench", "prefill", "--model", "demo-phi3", "--cache-dir", str(tmp_path), "--rounds", "2", "--streams", "2"]
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
