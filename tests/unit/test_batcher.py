"""Dynamic batching: the pure plan table-tested with a fake clock, then the device thread."""

from __future__ import annotations

import threading
import time

import pytest

from edge_agent.errors import EdgeAgentError, Overloaded
from edge_agent.serving.asr.batcher import Batcher, BatchLimits, BatchPlan, Waiting, take_batch

L = BatchLimits(max_batch=4, batch_timeout_ms=80.0, preferred_batch_sizes=())
P = BatchLimits(max_batch=4, batch_timeout_ms=80.0, preferred_batch_sizes=(2, 4))


def w(*since, urgent=()):
    return [Waiting(s, i in urgent) for i, s in enumerate(since)]


@pytest.mark.parametrize(
    "pending, now, limits, plan",
    [
        (w(), 0.0, L, BatchPlan(0)),  # nothing queued
        (w(0.0), 0.0, L, BatchPlan(0, 0.08)),  # alone: wait for company until the timeout
        (w(0.0), 0.079, L, BatchPlan(0, 0.08)),
        (w(0.0), 0.08, L, BatchPlan(1)),  # timeout reached: go with what there is
        (w(0.0, 0.05), 0.081, L, BatchPlan(2)),  # the oldest one's timeout counts
        (w(0.0, 0.01, 0.02, 0.03), 0.03, L, BatchPlan(4)),  # full batch: at once
        (w(0.0, 0.01, 0.02, 0.03, 0.04, 0.05), 0.05, L, BatchPlan(4)),  # never more than max_batch
        (w(0.0, urgent=(0,)), 0.0, L, BatchPlan(1)),  # an end of speech does not wait
        (w(0.0, 0.01, urgent=(1,)), 0.01, L, BatchPlan(2)),  # and takes the others along
        (w(0.0, 0.01), 0.01, P, BatchPlan(2)),  # a preferred size is reached: at once
        (w(0.0, 0.01, 0.02), 0.02, P, BatchPlan(2)),  # the largest preferred size the queue fills
        (w(0.0), 0.0, P, BatchPlan(0, 0.08)),
        (w(0.0), 0.0, BatchLimits(max_batch=4, batch_timeout_ms=0), BatchPlan(1)),  # no timeout: never wait
        (w(5.0, 5.0, 5.0), 5.0, BatchLimits(max_batch=1), BatchPlan(1)),
    ],
)
def test_take_batch(pending, now, limits, plan):
    assert take_batch(pending, now, limits) == plan


def test_device_thread_batches_concurrent_requests_and_resolves_each():
    seen, gate = [], threading.Event()

    def run(items):
        gate.wait(5)
        seen.append(list(items))
        return [x * 10 for x in items]

    b = Batcher(run, BatchLimits(max_batch=3, batch_timeout_ms=10_000, adaptive=False)).start()
    try:
        futures = [b.submit(i) for i in range(7)]
        gate.set()
        assert [f.result(5) for f in futures[:6]] == [i * 10 for i in range(6)]
        assert not futures[6].done()  # alone, it waits for company (10 s timeout)
    finally:
        b.stop(5)
    assert futures[6].result(0) == 60
    assert [len(s) for s in seen] == [3, 3, 1]  # the last one goes when stop() drains the queue
    assert b.batches == 3 and b.batch_sizes == {3: 2, 1: 1}


def test_a_failing_batch_fails_only_its_requests():
    calls = []

    def run(items):
        calls.append(items)
        if -1 in items:
            raise EdgeAgentError("engine failed")
        return items

    b = Batcher(run, BatchLimits(max_batch=2, batch_timeout_ms=0)).start()
    try:
        bad = b.submit(-1)
        with pytest.raises(EdgeAgentError, match="engine failed"):
            bad.result(5)
        assert b.submit(7).result(5) == 7  # the thread survived
    finally:
        b.stop(5)


def test_wrong_result_count_and_unexpected_exceptions_are_contained():
    b = Batcher(lambda items: [], BatchLimits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        with pytest.raises(EdgeAgentError, match="0 results for a batch of 1"):
            b.submit(1).result(5)
    finally:
        b.stop(5)
    b = Batcher(lambda items: 1 / 0, BatchLimits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        with pytest.raises(ZeroDivisionError):
            b.submit(1).result(5)
        assert b.batches == 1
    finally:
        b.stop(5)


def test_bounded_queue_and_stopping_reject_new_requests():
    gate = threading.Event()
    limits = BatchLimits(max_batch=1, batch_timeout_ms=0, max_queue=2)
    b = Batcher(lambda items: (gate.wait(5), items)[1], limits).start()
    try:
        first = b.submit(0)
        # the first may already be running; fill the queue to its bound
        extra = [b.submit(i) for i in (1, 2)] if b.queued == 0 else [b.submit(1)]
        with pytest.raises(Overloaded, match="max_queue 2"):
            for _ in range(3):
                b.submit(99)
        gate.set()
        assert first.result(5) == 0 and all(f.result(5) is not None for f in extra)
    finally:
        gate.set()
        b.stop(5)
    with pytest.raises(Overloaded, match="stopping"):
        b.submit(1)


def test_dropped_requests_leave_the_queue_unrun_and_free_their_slots():
    gate, ran = threading.Event(), []

    def run(items):
        gate.wait(5)
        ran.extend(items)
        return items

    b = Batcher(run, BatchLimits(max_batch=1, batch_timeout_ms=0, max_queue=3)).start()
    try:
        running = b.submit("a0")
        deadline = time.monotonic() + 5
        while b.queued and time.monotonic() < deadline:  # a0 is taken by the device thread
            time.sleep(0.005)
        queued = [b.submit(x) for x in ("a1", "b1", "a2")]
        with pytest.raises(Overloaded):
            b.submit("b2")  # full
        assert b.drop(lambda item: item.startswith("a")) == 2
        assert queued[0].cancelled() and queued[2].cancelled() and not queued[1].cancelled()
        later = b.submit("b2")  # the dropped ones no longer count against max_queue
        gate.set()
        assert running.result(5) == "a0" and queued[1].result(5) == "b1" and later.result(5) == "b2"
    finally:
        gate.set()
        b.stop(5)
    assert ran == ["a0", "b1", "b2"]  # a running batch finishes; dropped ones never run
    assert b.dropped == 2 and b.drop(lambda item: True) == 0


def test_a_future_its_caller_cancelled_is_not_run():
    gate, ran = threading.Event(), []
    b = Batcher(
        lambda items: (gate.wait(5), ran.extend(items), items)[2], BatchLimits(max_batch=2, batch_timeout_ms=0)
    ).start()
    try:
        first = b.submit(1)
        deadline = time.monotonic() + 5
        while b.queued and time.monotonic() < deadline:
            time.sleep(0.005)
        second, third = b.submit(2), b.submit(3)
        assert second.cancel() and not first.cancel()  # queued: cancellable; running: not
        gate.set()
        assert first.result(5) == 1 and third.result(5) == 3
    finally:
        gate.set()
        b.stop(5)
    assert ran == [1, 3]


class _Stoppable:
    """A run_batch the test holds per batch; ``interrupt`` releases it raising ``Interrupted``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stopped = False
        self.resumed = 0
        self.seen: list[list[str]] = []

    def run(self, items):
        self.seen.append(list(items))
        if items[0].startswith("hold"):
            self.entered.set()
            assert self.release.wait(10.0)
        if self.stopped:
            from edge_agent.errors import Interrupted

            raise Interrupted("stopped")
        return [f"{i}!" for i in items]

    def interrupt(self) -> None:
        self.stopped = True
        self.release.set()

    def resume(self) -> None:
        self.stopped = False
        self.resumed += 1


@pytest.mark.parametrize("urgent", [False, True])
def test_preempt_stops_the_running_batch_that_holds_the_caller_s_item(urgent):
    from edge_agent.errors import Interrupted

    eng = _Stoppable()
    b = Batcher(eng.run, BatchLimits(max_batch=2, batch_timeout_ms=0), stoppable=eng).start()
    try:
        held = b.submit("hold-a", urgent=urgent)
        assert eng.entered.wait(10.0)
        assert not b.preempt(lambda item: item == "nothing-running")  # names nothing in the batch
        stopped = b.preempt(lambda item: item == "hold-a")
        # the caller's own item may be stopped even when urgent (it no longer wants it)
        assert stopped and b.preempted == 1
        with pytest.raises(Interrupted):
            held.result(10.0)
        assert b.submit("next").result(10.0) == "next!"  # resumed before the next batch
        assert eng.resumed >= 2
    finally:
        eng.release.set()
        b.stop()


def test_preempt_leaves_a_batch_holding_another_caller_s_urgent_request():
    eng = _Stoppable()
    limits = BatchLimits(max_batch=2, batch_timeout_ms=0, preferred_batch_sizes=(2,))
    b = Batcher(eng.run, limits, stoppable=eng)
    first, second = b.submit("hold-mine"), b.submit("theirs", urgent=True)  # queued together, one batch
    b.start()
    try:
        assert eng.entered.wait(10.0)
        assert not b.preempt(lambda item: item == "hold-mine") and b.preempted == 0
        eng.release.set()
        assert (first.result(10.0), second.result(10.0)) == ("hold-mine!", "theirs!")
    finally:
        eng.release.set()
        b.stop()


def test_preempt_without_an_engine_that_can_stop_does_nothing():
    eng = _Stoppable()
    b = Batcher(eng.run, BatchLimits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        fut = b.submit("hold-x")
        assert eng.entered.wait(10.0)
        assert not b.preempt(lambda item: True)
        eng.release.set()
        assert fut.result(10.0) == "hold-x!"
    finally:
        eng.release.set()
        b.stop()
