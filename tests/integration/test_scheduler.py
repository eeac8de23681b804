"""The continuous-batching scheduler on a real demo model (ONNX Runtime, CPU)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.errors import DeadlineExceeded, EdgeAgentError, Overloaded
from edge_agent.models.catalog import DEMO_DIR, resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.admission import INTERACTIVE
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler


def reference(name: str, lm: DecoderLM) -> dict[str, np.ndarray]:
    """The PyTorch reference's prompts, and their greedy tokens as served: the bare loop over the ids the
    tokenizer defines (test_conformance checks that loop over every logit against PyTorch's tokens)."""
    with np.load(DEMO_DIR / name / "reference.npz") as npz:
        ref = {k: npz[k] for k in npz.files}
    for prompt, greedy_key in (("prompt_ids", "greedy_ids"), ("prompt2_ids", "greedy2_ids")):
        n = len(ref[greedy_key])
        ref[greedy_key] = np.asarray(list(lm.generate_greedy(ref[prompt].tolist(), n, stop_at_eos=False)))
    return ref


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model = DecoderLM.open(
        resolve_model("demo-gemma2", tmp_path_factory.mktemp("m")), "onnxruntime", SessionOptions(threads=1)
    )
    yield model
    model.close()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_concurrent_requests_joining_mid_flight_get_their_reference_tokens(lm):
    ref = reference("demo-gemma2", lm)
    timings = []
    sched = LLMScheduler(lm, Limits(max_batch=4, batch_timeout_ms=5), on_finished=timings.append).start()
    try:
        first = sched.submit(ref["prompt_ids"].tolist(), greedy(len(ref["greedy_ids"])))
        events = iter(first)
        for _ in range(5):  # let it decode a few tokens alone
            next(events)
        second = sched.submit(ref["prompt2_ids"].tolist(), greedy(len(ref["greedy2_ids"])))
        third = sched.submit(ref["prompt_ids"].tolist(), greedy(6))
        assert list(first.result(30).token_ids) == ref["greedy_ids"].tolist()
        assert list(second.result(30).token_ids) == ref["greedy2_ids"].tolist()
        assert list(third.result(30).token_ids) == ref["greedy_ids"].tolist()[:6]
        assert first.result().finish_reason == "length"
    finally:
        sched.stop()
    assert len(timings) == 3 and all(t.ttft_ms is not None and t.ttft_ms > 0 for t in timings)
    assert sorted(t.tokens_out for t in timings) == sorted([len(ref["greedy_ids"]), len(ref["greedy2_ids"]), 6])


def test_streamed_pieces_add_up_to_the_text_and_stop_strings_cut_it(lm):
    ref = reference("demo-gemma2", lm)
    sched = LLMScheduler(lm, Limits(batch_timeout_ms=0)).start()
    try:
        handle = sched.submit(ref["prompt_ids"].tolist(), greedy(12))
        pieces = [e.text for e in handle]
        full = handle.result().text
        assert "".join(pieces) == full
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        if not stop.strip():
            pytest.skip("random model text has no usable stop string here")
        cut = sched.submit(ref["prompt_ids"].tolist(), SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))
        streamed = "".join(e.text for e in cut)
        done = cut.result()
        assert done.finish_reason == "stop"
        assert done.text == full[: full.index(stop)] == streamed
    finally:
        sched.stop()


def test_bounded_queue_overloads_and_queue_timeout_rejects(lm):
    gate = threading.Event()
    real_forward = lm.forward

    def slow_forward(*args):
        gate.wait(10)
        return real_forward(*args)

    lm.forward = slow_forward
    sched = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0, max_queue=2, queue_timeout_ms=50)).start()
    try:
        busy = sched.submit([5, 6, 7], greedy(2))
        import time

        time.sleep(0.05)  # the device thread has taken `busy` and is blocked in its prefill
        waiting = [sched.submit([5, 6], greedy(2)) for _ in range(2)]
        with pytest.raises(Overloaded, match="queue full"):
            sched.submit([5], greedy(2))
        time.sleep(0.1)
        gate.set()
        for handle in waiting:
            with pytest.raises(DeadlineExceeded, match="waited"):
                handle.result(10)
        assert len(busy.result(10).token_ids) == 2
    finally:
        lm.forward = real_forward
        sched.stop()


def test_an_interactive_request_goes_ahead_of_the_queue_behind_earlier_interactive_ones(lm):
    """A voice turn's reply (tagged INTERACTIVE) is admitted before requests that were already waiting,
    after interactive ones that came before it; the rest keep their order."""
    entered, gate = threading.Event(), threading.Event()
    real_join = lm.join

    def held_join(*args):
        entered.set()
        gate.wait(10)
        return real_join(*args)

    done: list[int] = []
    lm.join = held_join
    sched = LLMScheduler(
        lm, Limits(max_batch=1, batch_timeout_ms=0), on_finished=lambda t: done.append(t.tokens_in)
    ).start()
    try:
        busy = sched.submit([5, 6, 7], greedy(1))
        assert entered.wait(10)  # the device thread holds `busy` in its prefill: everything else queues
        handles = [
            sched.submit([5] * 4, greedy(1)),
            sched.submit([5] * 5, greedy(1)),
            sched.submit([5] * 6, greedy(1), tags=(INTERACTIVE,)),
            sched.submit([5] * 7, greedy(1)),
            sched.submit([5] * 8, greedy(1), tags=(INTERACTIVE,)),
        ]
        gate.set()
        for handle in (busy, *handles):
            handle.result(10)
        assert done == [3, 6, 8, 4, 5, 7]
    finally:
        lm.join = real_join
        sched.stop()


def test_a_failing_batch_fails_only_its_requests_and_serving_continues(lm):
    real_forward = lm.forward
    calls = {"n": 0}

    def flaky_forward(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise EdgeAgentError("injected engine failure")
        return real_forward(*args)

    sched = LLMScheduler(lm, Limits(batch_timeout_ms=0))  # its load-time timing runs before the fault
    lm.forward = flaky_forward
    sched.start()
    try:
        doomed = sched.submit([5, 6, 7], greedy(3))
        with pytest.raises(EdgeAgentError, match="injected"):
            doomed.result(10)
        ok = sched.submit([5, 6, 7], greedy(3))
        assert len(ok.result(10).token_ids) == 3
    finally:
        lm.forward = real_forward
        sched.stop()


def test_cancel_ends_a_stream_early_and_stop_drains(lm):
    sched = LLMScheduler(lm, Limits(batch_timeout_ms=0)).start()
    handle = sched.submit([5, 6, 7], greedy(200))
    events = iter(handle)
    next(events)
    handle.cancel()
    done = handle.result(10)
    assert done.finish_reason == "cancelled" and len(done.token_ids) < 200
    last = sched.submit([5, 6], greedy(4))
    sched.stop()
    assert len(last.result(1).token_ids) == 4  # stop() drained it
    with pytest.raises(Overloaded, match="shutting down"):
        sched.submit([5], greedy(1))


def test_genai_folder_with_in_place_kv_serves_joining_requests_with_reference_tokens(tmp_path):
    """An onnxruntime-genai folder (GroupQueryAttention, past = present buffers) through the scheduler:
    requests that join and leave mid-flight still produce demo-phi3's greedy tokens (the bare loop on
    the plain export, over the ids its tokenizer defines)."""
    from pathlib import Path

    from edge_agent.models.catalog import inspect_folder
    from edge_agent.models.kv_slots import SlotCache

    folder = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"
    genai = DecoderLM.open(inspect_folder(folder), "onnxruntime", SessionOptions(threads=1))
    plain = DecoderLM.open(resolve_model("demo-phi3", tmp_path), "onnxruntime", SessionOptions(threads=1))
    try:
        ref = reference("demo-phi3", plain)
    finally:
        plain.close()
    sched = LLMScheduler(genai, Limits(max_batch=2, batch_timeout_ms=0)).start()
    try:
        assert isinstance(sched._batch, SlotCache)
        long_ = sched.submit(ref["prompt_ids"].tolist(), greedy(len(ref["greedy_ids"])))
        short = [sched.submit(ref["prompt2_ids"].tolist(), greedy(4 + i)) for i in range(3)]
        assert list(long_.result(30).token_ids) == ref["greedy_ids"].tolist()
        for i, handle in enumerate(short):
            assert list(handle.result(30).token_ids) == ref["greedy2_ids"].tolist()[: 4 + i]
    finally:
        sched.stop()
        genai.close()


def test_cancelling_a_waiting_request_frees_it_at_once_even_while_the_batch_fills(lm):
    # A lone request waits up to batch_timeout_ms for companions; cancelling it must not wait that out.
    fixed = Limits(max_batch=4, batch_timeout_ms=20_000, preferred_batch_sizes=(4,), adaptive=False)
    sched = LLMScheduler(lm, fixed).start()
    try:
        handle = sched.submit([5, 6, 7], greedy(8))
        threading.Event().wait(0.2)
        assert sched.load == (1, 0)
        handle.cancel()
        done = handle.result(3)  # well before the 20 s batch timeout
        assert done.finish_reason == "cancelled" and done.token_ids == ()
        assert sched.load == (0, 0)
    finally:
        sched.stop(5)
