"""serving.urgency: background work waits while urgent work holds it, never past its bound."""

from __future__ import annotations

import threading

import pytest

from edge_agent.serving.urgency import Urgency


def test_nothing_held_costs_nothing_and_holds_nest():
    u = Urgency()
    assert u.wait_clear() == 0.0 and not u.active
    with u.held():
        with u.held():
            assert u.active
        assert u.active  # the outer hold still counts
    assert not u.active and u.wait_clear() == 0.0


def test_the_expected_rest_of_a_hold_is_the_recent_spans_mean_less_its_age():
    clock = [10.0]
    u = Urgency(clock=lambda: clock[0])
    with u.held():  # the first span: nothing to expect from yet
        assert u.expected_left_s() == 0.0
        clock[0] += 0.4
    assert u.expected_left_s() == 0.0  # nothing held
    with u.held():
        with u.held():  # nested and concurrent holds are one span
            clock[0] += 0.1
            assert u.expected_left_s() == pytest.approx(0.3)
        clock[0] += 0.7  # past the mean: nothing more expected
        assert u.expected_left_s() == 0.0
    # the second span (0.8 s) moved the mean a quarter of the way: 0.4 + 0.25 x 0.4
    with u.held():
        assert u.expected_left_s() == pytest.approx(0.5)


def test_a_speaker_talking_now_counts_as_the_share_of_their_rest_of_speech_a_time_covers():
    clock = [10.0]
    u = Urgency(clock=lambda: clock[0])
    assert u.turns_expected(5.0) == 0.0 and u.turn_cost_s() == 0.0  # nobody talking, nothing learnt
    u.speech_started("a")
    # no utterance has ended here yet: one is expected to last 2 s, all of it still to come
    assert u.turns_expected(0.5) == pytest.approx(0.25)
    clock[0] += 1.5
    assert u.turns_expected(0.25) == pytest.approx(0.5)  # 0.5 s of it left
    clock[0] += 1.0  # past the expected length: still talking, so the turn may start any moment
    assert u.turns_expected(0.05) == pytest.approx(0.5)  # at least 0.1 s left (the shortest end of turn)
    assert u.turns_expected(10.0) == 1.0  # never more than one turn per speaker
    u.speech_ended("a")  # 2.5 s long: the first one learnt is the expected length
    assert u.turns_expected(10.0) == 0.0
    u.speech_started("b")
    u.speech_started("c")
    assert u.turns_expected(0.25) == pytest.approx(0.2)  # two speakers, a tenth of the rest each
    clock[0] += 1.0
    u.speech_ended("b", learn=False)  # cut short (the stream went away): no length learnt
    u.speech_ended("nobody")  # never started: nothing happens
    assert u.turns_expected(0.15) == pytest.approx(0.1)  # c alone, 1.5 s left by the same mean
    u.speech_ended("c")  # 1 s long: the expected length moves a quarter of the way, 2.5 -> 2.125
    u.speech_started("d")
    assert u.turns_expected(0.2125) == pytest.approx(0.1)
    clock[0] += 200.0
    assert u.turns_expected(1.0) == 0.0  # announced long ago and never ended: not counted


def test_a_turns_cost_is_a_recent_pass_and_a_recent_reply():
    clock = [10.0]
    u = Urgency(clock=lambda: clock[0])
    with u.held():
        clock[0] += 0.3
    assert u.turn_cost_s() == pytest.approx(0.3)  # no voice reply seen yet: the pass alone
    u.reply_done(0.4)
    u.reply_done(0.8)  # 0.4 + 0.25 x 0.4
    assert u.turn_cost_s() == pytest.approx(0.3 + 0.5)


def test_a_waiter_never_waits_past_its_bound():
    u = Urgency(max_yield_s=0.05)
    with u.held():
        waited = u.wait_clear()
    assert 0.04 <= waited < 5.0 and u.yielded_s == waited


def test_the_release_wakes_a_waiter_at_once():
    u = Urgency(max_yield_s=30.0)
    started, waited = threading.Event(), []
    with u.held():
        t = threading.Thread(target=lambda: (started.set(), waited.append(u.wait_clear())))
        t.start()
        started.wait(5)
    t.join(10)  # released: it returns now, not after its 30 s bound
    assert not t.is_alive() and waited[0] < 10.0


def test_the_recogniser_holds_urgency_while_an_urgent_batch_runs_and_only_then():
    from edge_agent.serving.asr.batcher import Batcher, BatchLimits

    u = Urgency()
    seen: list[tuple[str, bool]] = []
    limits = BatchLimits(max_batch=1, batch_timeout_ms=0)
    batcher = Batcher(lambda items: [seen.append((i, u.active)) for i in items], limits, urgency=u).start()
    try:
        batcher.submit("partial").result(10)
        batcher.submit("final", urgent=True).result(10)
        assert not u.active  # released with the batch
        batcher.submit("next partial").result(10)
    finally:
        batcher.stop()
    assert seen == [("partial", False), ("final", True), ("next partial", False)]
    unheld: list[bool] = []
    batcher = Batcher(lambda items: [unheld.append(u.active) for _ in items], limits, urgency=None).start()
    try:
        batcher.submit("final", urgent=True).result(10)
    finally:
        batcher.stop()
    assert unheld == [False]
