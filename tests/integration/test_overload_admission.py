"""Overload on a real demo model (ONNX Runtime, CPU): a voice turn preempts a chat whose output stays the
reference's, admission refuses what would miss its budget, warm-ups take only free rows, and a switch
moves every waiting request to the new tier (without a load when the tiers share weights)."""

from __future__ import annotations

import functools
import itertools
import re
import threading

import pytest

from edge_agent.backends import SessionOptions
from edge_agent.errors import Overloaded, Unavailable
from edge_agent.metrics.window import WARMUP
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.admission import INTERACTIVE
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler
from edge_agent.serving.llm.tiers import Tier, TieredLLM
from edge_agent.serving.tiers.admission import Lateness
from edge_agent.serving.urgency import Urgency

PROMPT = [2, 10, 20, 30, 40, 50, 60, 70]
OTHER = [2, 11, 21, 31]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return resolve_model("demo-gemma2", tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def lm(folder):
    model = DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))
    yield model
    model.close()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _gated_model(folder, gate: threading.Event) -> DecoderLM:
    """The demo model whose decode steps wait on ``gate``: a running chat holds its row (and the device
    thread) as long as the test says."""
    model = DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))
    step = model.decode_runs

    def gated(*args, **kwargs):
        gate.wait(60)
        return step(*args, **kwargs)

    model.decode_runs = gated  # type: ignore[method-assign]
    return model


def test_a_voice_turn_preempts_a_chat_and_the_chat_resumes_with_its_reference_tokens(lm):
    expected = list(lm.generate_greedy(PROMPT, 30, stop_at_eos=False))
    timings = []
    sched = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0), on_finished=timings.append).start()
    try:
        chat = sched.submit(PROMPT, greedy(30))
        events = iter(chat)
        for _ in range(5):  # it holds the only row, five tokens in
            next(events)
        voice = sched.submit(OTHER, greedy(4), tags=(INTERACTIVE,))
        voice_done = voice.result(30)
        chat_done = chat.result(30)
    finally:
        sched.stop()
    assert sched.preemptions == 1
    assert list(chat_done.token_ids) == expected  # resumed from its own KV: the same tokens
    assert list(voice_done.token_ids) == list(lm.generate_greedy(OTHER, 4, stop_at_eos=False))
    # the only row went to the voice turn: it finished while the chat waited
    assert voice_done.timing.finished_s < chat_done.timing.finished_s
    assert chat_done.timing.ttft_ms is not None and len(chat_done.timing.token_times_s) == 30


def test_a_voice_turn_decodes_alone_beside_chats_and_every_output_is_its_reference(folder):
    model = DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))
    third = [2, 12, 22, 32, 42]
    expected = {tuple(p): list(model.generate_greedy(p, n, stop_at_eos=False)) for p, n in
                ((PROMPT, 24), (third, 24), (OTHER, 6))}  # fmt: skip
    alone: list[int] = []
    extend = model.extend

    def counted(batch, index, tokens):  # a row stepped by itself (no chat in this test has a forced run)
        alone.append(index)
        return extend(batch, index, tokens)

    model.extend = counted  # type: ignore[method-assign]
    sched = LLMScheduler(model, Limits(max_batch=3, batch_timeout_ms=0)).start()
    try:
        chats = [sched.submit(PROMPT, greedy(24)), sched.submit(third, greedy(24))]
        for chat in chats:
            next(iter(chat))  # both decoding (their first tokens came from their prefills)
        # each turn of the device thread moves a chat one token at most: they have 20 and more to go
        voice = sched.submit(OTHER, greedy(6), tags=(INTERACTIVE,))
        voice_done = voice.result(30)
        assert not any(chat.done for chat in chats)  # the chats waited while the voice turn decoded
        chat_done = [chat.result(30) for chat in chats]
    finally:
        sched.stop()
        model.close()
    assert len(alone) == 5 and len(set(alone)) == 1  # the voice row's five decode steps, each by itself
    assert list(voice_done.token_ids) == expected[tuple(OTHER)]
    assert [list(c.token_ids) for c in chat_done] == [expected[tuple(PROMPT)], expected[tuple(third)]]


def test_a_loaded_scheduler_predicts_from_its_own_timing_before_any_request(lm):
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0))
    rates = sched.rates.snapshot(sched.clock())
    assert rates is not None and rates.step_ms > 0 and rates.prefill_ms_per_token >= 0  # a tiny model: maybe ~0
    assert sched.load == (0, 0) and sched.free_rows() == 2  # the timed prefill left nothing behind
    # an idle scheduler: a 100-token prompt's first token is its own prefill, from the seeded rates
    predicted = sched.predict_ttft_ms(100)
    assert predicted == pytest.approx(rates.step_ms + 100 * rates.prefill_ms_per_token)
    sched.start()
    try:  # and the batch the timing used still serves the reference's tokens
        done = sched.submit(PROMPT, greedy(6)).result(30)
    finally:
        sched.stop()
    assert list(done.token_ids) == list(lm.generate_greedy(PROMPT, 6, stop_at_eos=False))


def test_a_warm_up_takes_a_free_row_or_none(lm):
    sched = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0)).start()
    ladder_free = sched.free_rows()
    try:
        chat = sched.submit(PROMPT, greedy(40))
        next(iter(chat))
        warm = sched.submit(OTHER, greedy(1), tags=(WARMUP, INTERACTIVE))
        with pytest.raises(Overloaded, match="no free row for a warm-up"):
            warm.result(30)
        assert chat.result(30).finish_reason == "length"
    finally:
        sched.stop()
    assert ladder_free == 1


def _ladder(folder, opened: list[str], tiers=None, **kwargs) -> TieredLLM:
    def opener(name):
        def open_tier():
            opened.append(name)
            return DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))

        return open_tier

    tiers = tiers or [
        Tier("full", opener("full"), Limits(max_batch=1, batch_timeout_ms=0), 40, weights="demo"),
        Tier("short", opener("short"), Limits(max_batch=2, batch_timeout_ms=0), 6, weights="demo"),
    ]
    return TieredLLM(tiers, **kwargs).start()


def test_a_chat_predicted_over_its_budget_is_refused_at_once_and_a_voice_turn_is_not(folder):
    gate = threading.Event()
    gate.set()

    def gated_open():  # decode steps wait on the gate: a chat ahead holds its row as long as the test says
        return _gated_model(folder, gate)

    tiers = [
        Tier("full", gated_open, Limits(max_batch=1, batch_timeout_ms=0), 40, weights="demo"),
        Tier("short", gated_open, Limits(max_batch=2, batch_timeout_ms=0), 6, weights="demo"),
    ]
    ladder = _ladder(folder, [], tiers)
    try:
        ladder.submit("warm the rates up", greedy(3), raw=True).result(30)
        ladder.sla_ms = lambda: 0.001  # no first token can come that fast
        alone = ladder.submit("an idle tier serves one", greedy(3), raw=True)  # refusing it would protect no one
        assert len(alone.result(30).token_ids) == 3
        gate.clear()
        running = ladder.submit("a long one ahead", greedy(40), raw=True)
        next(iter(running))  # its first token came from its prefill; its next step waits for the gate
        with pytest.raises(Overloaded) as refused:
            ladder.submit("hello there", greedy(3), raw=True)
        assert refused.value.retry_after_s >= 1 and "budget" in str(refused.value)
        assert ladder.load == (0, 1)  # nothing was queued
        gate.set()
        assert len(running.result(30).token_ids) == 40
        voice = ladder.submit("turn on the light", greedy(3), raw=True, tags=(INTERACTIVE,))
        assert voice.result(30).finish_reason == "length"
        counted = ladder.pressure()
        assert (counted.arrivals, counted.over_budget, counted.refused) == (3, 1, 1)  # the idle one, the long one
        ladder.sla_ms = lambda: 60_000.0
        assert ladder.submit("hello there", greedy(3), raw=True, budget_ms=60_000).result(30).token_ids
    finally:
        ladder.stop()


def test_a_switch_between_tiers_sharing_weights_loads_nothing_and_moves_the_waiting(folder):
    opened: list[str] = []
    ladder = _ladder(folder, opened)
    try:
        running = ladder.submit("a long one", greedy(40), raw=True)
        next(iter(running))
        waiting = [ladder.submit(f"waiting {i}", greedy(30), raw=True) for i in range(3)]
        assert ladder.load[0] == 3
        assert ladder.switch_to(1)
        ladder.wait_switched(30)
        assert opened == ["full"]  # one model for both tiers
        assert ladder.active_tier == "short"
        done = [h.result(60) for h in waiting]
        # every waiting request was served by the new tier, under its reply cap of 6
        assert [h.tier for h in waiting] == ["short"] * 3
        assert [len(d.token_ids) for d in done] == [6, 6, 6]
        assert len(running.result(60).token_ids) == 40  # the running one kept what it was granted
    finally:
        ladder.stop()


def test_a_switch_to_other_weights_moves_the_waiting_to_the_new_model(folder):
    opened: list[str] = []
    gate = threading.Event()  # the top tier's decode steps wait on it: its row stays busy through the switch

    def opener(name):
        def open_tier():
            opened.append(name)
            model = DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))
            if name == "top":
                step = model.decode_runs

                def gated(*args, **kwargs):
                    gate.wait(60)
                    return step(*args, **kwargs)

                model.decode_runs = gated  # type: ignore[method-assign]
            return model

        return open_tier

    tiers = [
        Tier("top", opener("top"), Limits(max_batch=1, batch_timeout_ms=0), 40),
        Tier("low", opener("low"), Limits(max_batch=4, batch_timeout_ms=0), 8),
    ]
    ladder = TieredLLM(tiers).start()
    try:
        running = ladder.submit("a long one", greedy(40), raw=True)
        next(iter(running))  # its first token comes from its prefill; its next step waits for the gate
        waiting = [ladder.submit(f"waiting {i}", greedy(30), raw=True) for i in range(3)]
        assert ladder.switch_to(1)
        while ladder.active_tier != "low":
            ladder.wait_switched(0.05)  # the switch thread swaps, then drains the old tier (held by the gate)
        gate.set()
        done = [h.result(60) for h in waiting]
        ladder.wait_switched(60)
        assert opened == ["top", "low"]
        assert [h.tier for h in waiting] == ["low"] * 3 and [len(d.token_ids) for d in done] == [8, 8, 8]
        assert len(running.result(60).token_ids) == 40  # the old tier finished the row it ran
    finally:
        ladder.stop()


def test_after_a_switch_the_draining_tier_and_the_new_one_never_step_at_once(folder, lm):
    """The old tier finishes its row while the new one serves the moved requests: their engine calls take
    turns at the step gate (never two at once on the cores), and every reply is its reference's."""
    switched = threading.Event()  # set as the new tier takes over: loading it ran beside serving, uncounted
    overlapped = threading.Event()
    lock = threading.Lock()
    inside = {"now": 0, "most": 0, "calls": 0}

    def opener(name):
        # the top tier's row stands still until the switch: the requests behind it wait and move
        model = (
            _gated_model(folder, switched)
            if name == "top"
            else DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))
        )
        run = model.session.run

        def watched(*args, **kwargs):
            with lock:
                counted = switched.is_set()
                if counted:
                    inside["now"] += 1
                    inside["calls"] += 1
                    inside["most"] = max(inside["most"], inside["now"])
                    if inside["now"] > 1:
                        overlapped.set()
            try:
                if counted:
                    overlapped.wait(0.02)  # a call long enough for the other tier's to come in beside it
                return run(*args, **kwargs)
            finally:
                if counted:
                    with lock:
                        inside["now"] -= 1

        model.session.run = watched  # type: ignore[method-assign]
        return model

    tiers = [
        Tier("top", functools.partial(opener, "top"), Limits(max_batch=1, batch_timeout_ms=0), 40),
        Tier("low", functools.partial(opener, "low"), Limits(max_batch=4, batch_timeout_ms=0), 24),
    ]
    ladder = TieredLLM(tiers, on_switched=lambda *_: switched.set())
    ladder.load_ahead = False
    ladder.start()
    prompts = ["running"] + [f"waiting {i}" for i in range(3)]
    try:
        running = ladder.submit(prompts[0], greedy(40), raw=True)
        next(iter(running))  # it holds the top tier's row
        waiting = [ladder.submit(p, greedy(24), raw=True) for p in prompts[1:]]
        assert ladder.switch_to(1)
        done = [h.result(60) for h in [running, *waiting]]
        ladder.wait_switched(60)
    finally:
        ladder.stop()
    assert [h.tier for h in [running, *waiting]] == ["top", "low", "low", "low"]
    for prompt, reply, n in zip(prompts, done, [40, 24, 24, 24]):
        assert list(reply.token_ids) == list(lm.generate_greedy(lm.tokenizer.encode(prompt), n, stop_at_eos=False))
    assert inside["calls"] > 40 and inside["most"] == 1


def test_with_admission_on_the_controller_never_sheds_and_with_it_off_it_does(folder):
    ladder = _ladder(folder, [])
    try:
        ladder.relieve(True, 0.5)  # the controller, at the lightest tier over target
        assert not ladder.shedding and ladder.token_cap_ratio == 0.5  # admission refuses instead
        assert ladder.submit("hello there", greedy(2), raw=True).result(30).token_ids
        ladder.predictive = False
        ladder.relieve(True)
        assert ladder.shedding
        with pytest.raises(Unavailable, match="shedding load"):
            ladder.submit("hello there", greedy(2), raw=True)
    finally:
        ladder.stop()


def test_a_lighter_tier_with_other_weights_is_loaded_ahead_and_a_switch_down_loads_nothing(folder):
    opened: list[str] = []
    tiers = [
        Tier("top", _opener_of(folder, opened, "top"), Limits(max_batch=1, batch_timeout_ms=0), 40, weights="a"),
        Tier("low", _opener_of(folder, opened, "low"), Limits(max_batch=2, batch_timeout_ms=0), 8, weights="b"),
    ]
    ladder = TieredLLM(tiers).start()
    try:
        ladder.wait_ahead(60)
        assert opened == ["top", "low"]  # the lower tier loaded beside the serving one
        stale = ladder._active.ahead
        assert stale is not None and stale.tier.name == "low"
        # each built its output formats' token table as it loaded: no constrained request waits for one
        assert ladder._active.lm._token_vocab is not None and stale.lm._token_vocab is not None
        assert not ladder.reload_ahead("top")  # not the tier ahead
        assert ladder.reload_ahead("low")  # its engine changed: loaded ahead again, the old copy closed
        ladder.wait_ahead(60)
        low = ladder._active.ahead
        assert opened == ["top", "low", "low"] and low is not None and low is not stale and stale.scheduler._stopping
        assert ladder.switch_to(1)
        ladder.wait_switched(60)
        assert ladder.active_tier == "low" and ladder._active is low and opened == ["top", "low", "low"]
        assert len(ladder.submit("hello there", greedy(3), raw=True).result(30).token_ids) == 3
        assert ladder.switch_to(0)  # back up: the upper tier loads again, the lower one stays ahead
        ladder.wait_switched(60)
        assert opened == ["top", "low", "low", "top"] and ladder._active.ahead is low
        assert ladder.switch_to(1)
        ladder.wait_switched(60)
        assert opened == ["top", "low", "low", "top"] and ladder._active is low
    finally:
        ladder.stop()
    assert low.scheduler._stopping  # stopped with the ladder


def test_without_load_ahead_a_switch_down_loads_the_lighter_tier_then(folder):
    opened: list[str] = []
    tiers = [
        Tier("top", _opener_of(folder, opened, "top"), Limits(max_batch=1, batch_timeout_ms=0), 40, weights="a"),
        Tier("low", _opener_of(folder, opened, "low"), Limits(max_batch=2, batch_timeout_ms=0), 8, weights="b"),
    ]
    ladder = TieredLLM(tiers)
    ladder.load_ahead = False
    ladder.start()
    try:
        ladder.wait_ahead(60)
        assert opened == ["top"]
        assert ladder.switch_to(1)
        ladder.wait_switched(60)
        assert opened == ["top", "low"] and ladder.active_tier == "low"
    finally:
        ladder.stop()


def _opener_of(folder, opened: list[str], name: str):
    def open_tier():
        opened.append(name)
        return DecoderLM.open(folder, "onnxruntime", SessionOptions(threads=1))

    return open_tier


def test_a_waiting_chat_predicted_to_miss_its_start_deadline_is_refused_then_not_at_the_deadline(lm):
    clock = [100.0]  # a fake clock: no deadline passes while the test looks
    sched = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0), clock=lambda: clock[0])
    sched.rates.seed(10.0, 64, 10.0 + 64 * 0.5, clock[0])  # given: 10 ms a step, 0.5 ms a prompt token
    ahead = sched.enqueue(sched.prepare(PROMPT, greedy(40)))  # 8 prompt tokens, 40 to generate, one row
    seq = sched.prepare(OTHER, greedy(3), start_by_ms=50.0)
    seq.predicted_first_s = clock[0] + 0.040  # admission predicted its first token in 40 ms
    doomed = sched.enqueue(seq)
    fine = sched.enqueue(sched.prepare(OTHER, greedy(3), start_by_ms=5_000.0))
    # the row frees after the first one's prefill (10 + 8 x 0.5 ms) and 40 steps: 414 ms, far past 50 ms
    with sched._cond:
        assert sched._take_admitted()
    with pytest.raises(Overloaded, match="is now predicted to start") as refused:
        doomed.result(1)
    assert refused.value.reason == "start_deadline" and refused.value.retry_after_s == 1.0
    # it never has a first token: admission learns its lateness at its least, a start that late and its
    # prefill (10 + 4 x 0.5 ms), not nothing
    excess_ms = float(re.search(r"start (\d+) ms after", str(refused.value)).group(1))
    [(_, late_ms)] = list(sched.lateness._errors)
    assert late_ms == pytest.approx(50.0 + excess_ms + 12.0 - 40.0, abs=1.0)
    assert not fine.done and not ahead.done and sched.load == (1, 1)  # one prefilling, one still waiting
    sched.start()  # the clock stays: what was admitted runs, nothing else is refused
    try:
        assert len(ahead.result(30).token_ids) == 40 and len(fine.result(30).token_ids) == 3
    finally:
        sched.stop()


def test_a_waiting_chat_predicted_to_miss_its_start_takes_the_row_of_a_running_chat_once(lm):
    """Rescued instead of refused: the running chat with the most tokens left gives its row up (its KV kept)
    and resumes after, both outputs their references'; a chat that gave its row up once is never taken
    again, so the next late chat, with no row left to take, is refused."""
    clock = [100.0]  # a fake clock: no deadline passes while the test looks
    sched = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0), clock=lambda: clock[0])
    sched.rates.seed(10.0, 64, 10.0 + 64 * 0.5, clock[0])  # given: 10 ms a step, 0.5 ms a prompt token
    running = sched.enqueue(sched.prepare(PROMPT, greedy(40)))
    with sched._cond:
        assert sched._take_admitted()
    sched._prefill()  # it holds the only row, its first token out, 39 steps (390 ms) to go
    assert sched.load == (0, 1) and len(sched._batch) == 1
    late = sched.prepare(OTHER, greedy(3), start_by_ms=50.0)
    late.predicted_first_s = clock[0] + 0.040
    rescued = sched.enqueue(late)
    with sched._cond:
        assert sched._take_admitted()
    assert sched.preemptions == 1 and not rescued.done  # it prefills in the row the running chat gave up
    again = sched.prepare(PROMPT[:4], greedy(3), start_by_ms=50.0)
    again.predicted_first_s = clock[0] + 0.040
    refused = sched.enqueue(again)
    with sched._cond:
        assert sched._take_admitted()
    with pytest.raises(Overloaded, match="is now predicted to start"):
        refused.result(1)
    assert sched.preemptions == 1
    sched.start()
    try:
        assert list(rescued.result(30).token_ids) == list(lm.generate_greedy(OTHER, 3, stop_at_eos=False))
        assert list(running.result(30).token_ids) == list(lm.generate_greedy(PROMPT, 40, stop_at_eos=False))
    finally:
        sched.stop()


@pytest.mark.parametrize("voice_alone", [True, False])
def test_a_chats_prediction_counts_the_voice_reply_its_rows_stand_still_for(lm, voice_alone):
    clock = [100.0]  # a fake clock: nothing moves while the test looks
    limits = Limits(max_batch=2, batch_timeout_ms=0, voice_alone=voice_alone)
    sched = LLMScheduler(lm, limits, clock=lambda: clock[0])
    sched.rates.seed(10.0, 64, 10.0 + 64 * 0.5, clock[0])  # given: 10 ms a step, 0.5 ms a prompt token
    sched.enqueue(sched.prepare(PROMPT, greedy(5)))  # a chat with 5 tokens to go: 8 prompt tokens, 0.4 step
    sched.enqueue(sched.prepare(OTHER, greedy(20), tags=(INTERACTIVE,)))  # a voice reply of 20: 4 tokens, 0.2
    with sched._cond:
        assert sched._take_admitted()
    assert sched.load == (0, 2)  # nothing waits, both rows taken (prefilling)
    prefill = 10.0 + 4 * 0.5  # the new chat's own prefill of 4 tokens
    chat_frees, voice_frees = (1 + 0.4 + 5) * 10.0, (1 + 0.2 + 20) * 10.0
    # voice alone: the chat's row stands still for the voice reply, so the voice row frees first
    expected = voice_frees if voice_alone else chat_frees
    assert sched.predict_ttft_ms(len(OTHER)) == pytest.approx(expected + prefill)
    # a voice turn's own prediction is not stalled by the voice reply (it would decode beside it)
    assert sched.predict_ttft_ms(len(OTHER), interactive=True) == pytest.approx(chat_frees + prefill)


def _one_chat_running(lm) -> tuple[list[float], Urgency, LLMScheduler]:
    """A scheduler of one row, with an urgency of its own, on one fake clock (nothing moves while the test
    looks): 10 ms a step, 0.5 ms a prompt token, and a chat of 8 prompt tokens (0.4 step) with 5 to go."""
    clock = [100.0]
    urgency = Urgency(clock=lambda: clock[0])
    sched = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0), clock=lambda: clock[0], urgency=urgency)
    sched.rates.seed(10.0, 64, 10.0 + 64 * 0.5, clock[0])
    sched.enqueue(sched.prepare(PROMPT, greedy(5)))
    with sched._cond:
        assert sched._take_admitted()
    return clock, urgency, sched


def test_a_chats_prediction_counts_the_rest_of_a_recogniser_pass_its_steps_wait_for(lm):
    clock, urgency, sched = _one_chat_running(lm)
    with urgency.held():  # the recogniser's passes have lately held the cores 300 ms
        clock[0] += 0.3
    clock[0] += 1.0
    idle = sched.predict_ttft_ms(len(OTHER))
    assert idle == pytest.approx((1 + 0.4 + 5) * 10.0 + 10.0 + 4 * 0.5)  # the row frees, then its prefill
    with urgency.held():
        clock[0] += 0.1  # a pass 100 ms in: 200 ms more expected, for which the chat's steps wait
        assert sched.predict_ttft_ms(len(OTHER)) == pytest.approx(idle + 200.0)
        # a voice turn's steps never wait for the pass: its prediction stays
        assert sched.predict_ttft_ms(len(OTHER), interactive=True) == pytest.approx(idle)


def test_a_chats_prediction_counts_the_voice_turns_of_speakers_talking_now(lm):
    clock, urgency, sched = _one_chat_running(lm)
    with urgency.held():  # lately a recogniser pass held the cores 300 ms ...
        clock[0] += 0.3
    urgency.reply_done(0.2)  # ... and a voice reply the LLM 200 ms: a turn costs 500 ms
    quiet = sched.predict_ttft_ms(len(OTHER))
    assert quiet == pytest.approx((1 + 0.4 + 5) * 10.0 + 10.0 + 4 * 0.5)  # nobody talking: as before
    urgency.speech_started("speaker")  # 2 s of speech expected: a 76 ms wait covers 3.8 % of it
    assert sched.predict_ttft_ms(len(OTHER)) == pytest.approx(quiet + quiet / 2000.0 * 500.0)
    clock[0] += 1.95  # near the end of their speech: the turn is due within the wait
    assert sched.predict_ttft_ms(len(OTHER)) == pytest.approx(quiet + (quiet / 100.0) * 500.0)
    # a voice turn's own request is not held back by another's coming turn
    assert sched.predict_ttft_ms(len(OTHER), interactive=True) == pytest.approx(quiet)
    urgency.speech_ended("speaker")
    assert sched.predict_ttft_ms(len(OTHER)) == pytest.approx(quiet)


def test_a_voice_reply_tells_the_urgency_how_long_it_held_the_llm(lm):
    ticks = itertools.count()
    clock = lambda: 100.0 + next(ticks) * 1e-3  # noqa: E731 - every reading a millisecond later
    urgency = Urgency(clock=clock)
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0), clock=clock, urgency=urgency)
    sched.start()
    try:
        assert sched.submit(OTHER, greedy(3)).result(30).token_ids
        assert urgency.turn_cost_s() == 0.0  # a chat teaches nothing about voice replies
        reply = sched.submit(OTHER, greedy(3), tags=(INTERACTIVE,)).result(30)
        held = reply.timing.finished_s - reply.timing.scheduled_s
        assert held > 0 and urgency.turn_cost_s() == pytest.approx(held)  # no pass yet: the reply alone
    finally:
        sched.stop()


def test_the_scheduler_learns_how_late_first_tokens_come_against_their_predictions(lm):
    clock = [100.0]  # a fake clock that stands still: every first token comes at 100.0
    sched = LLMScheduler(lm, Limits(max_batch=4, batch_timeout_ms=0), clock=lambda: clock[0]).start()
    try:
        for k in range(20):
            seq = sched.prepare(OTHER, greedy(1))
            seq.predicted_first_s = clock[0] - (0.2 if k < 19 else 1.0)  # 19 come 200 ms late, one a second
            assert len(sched.enqueue(seq).result(30).token_ids) == 1
        assert sched.lateness_ms(387.0) == pytest.approx(200.0)  # the 95th percentile: not the one outlier
        assert sched.lateness_ms(387.0, clock[0] + 61) == 0.0  # aged out
        chat = sched.submit(OTHER, greedy(1))  # one admission predicted nothing for adds no sample
        assert chat.result(30).token_ids and sched.lateness_ms(387.0) == pytest.approx(200.0)
    finally:
        sched.stop()


def test_admission_adds_the_recent_lateness_to_its_prediction(folder):
    gate = threading.Event()
    gate.set()

    def gated_open():  # decode steps wait on the gate: a chat ahead holds its row as long as the test says
        return _gated_model(folder, gate)

    ladder = _ladder(folder, [], [Tier("full", gated_open, Limits(max_batch=1, batch_timeout_ms=0), 40)])
    try:
        ladder.submit("warm the rates up", greedy(3), raw=True).result(30)
        gate.clear()
        running = ladder.submit("a long one ahead", greedy(40), raw=True)
        next(iter(running))  # a busy tier: an idle one serves whatever arrives
        sched = ladder._active.scheduler
        now = sched.clock()
        with sched._cond:
            for _ in range(10):
                sched.lateness.observe(now - 1.0, now - 0.5)  # ten chats' first tokens came 500 ms late
        predicted = sched.predict_ttft_ms(4)
        assert predicted is not None
        ladder.sla_ms = lambda: predicted + 200.0  # the prediction alone fits, with room
        with pytest.raises(Overloaded, match="500 ms of recent lateness") as refused:
            ladder.submit("hi", greedy(3), raw=True)
        assert refused.value.reason == "over_budget" and refused.value.retry_after_s >= 1
        with sched._cond:
            sched.lateness = Lateness()  # no lateness: the same prediction is admitted
        admitted = ladder.submit("hi", greedy(3), raw=True)
        gate.set()
        assert len(admitted.result(30).token_ids) == 3 and len(running.result(30).token_ids) == 40
    finally:
        gate.set()
        ladder.stop()


def test_chat_steps_yield_to_urgent_work_and_a_voice_turns_steps_never_do(lm):
    urgency = Urgency(max_yield_s=0.02)
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0), urgency=urgency).start()
    try:
        with urgency.held():  # a final pass that lasts the whole test
            chat = sched.submit(OTHER, greedy(4))
            assert len(chat.result(30).token_ids) == 4  # each step waited its bound, then went: never stopped
            waited = urgency.yielded_s
            # the prefill's turn (which decodes the second token too) never waits: the first token is the SLA's;
            # the two decode steps after it each waited their bound
            assert waited >= 2 * 0.02 * 0.9
            voice = sched.submit(OTHER, greedy(4), tags=(INTERACTIVE,))
            assert len(voice.result(30).token_ids) == 4
            assert urgency.yielded_s == waited  # the voice turn's own steps took the cores at once
    finally:
        sched.stop()


def test_a_voice_turns_request_ends_a_chat_steps_wait_at_once(lm):
    urgency = Urgency(max_yield_s=60.0)  # a chat step would wait a minute for the pass to end
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0), urgency=urgency).start()
    try:
        with urgency.held():
            chat = sched.submit(OTHER, greedy(12))
            voice = sched.submit(OTHER, greedy(3), tags=(INTERACTIVE,))
            assert len(voice.result(20).token_ids) == 3  # not after the minute: its arrival ended the wait
            assert not chat.done  # 12 tokens: the chat decoded beside the voice turn, then yields again
        assert len(chat.result(30).token_ids) == 12
    finally:
        sched.stop()


def test_a_chat_past_its_start_deadline_is_refused_while_the_device_thread_is_in_a_long_step(folder):
    gate = threading.Event()
    model = _gated_model(folder, gate)  # a decode step lasts as long as the test says
    sched = LLMScheduler(model, Limits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        running = sched.submit(PROMPT, greedy(8))
        next(iter(running))  # its first token came from its prefill; the device thread is now held in a step
        late = sched.submit(OTHER, greedy(3), start_by_ms=30.0)
        with pytest.raises(Overloaded) as refused:
            late.result(10)  # answered by the watcher: the step it waits behind has not ended
        assert refused.value.reason == "start_deadline" and not gate.is_set()
        gate.set()
        assert len(running.result(30).token_ids) == 8
    finally:
        gate.set()
        sched.stop()
        model.close()
