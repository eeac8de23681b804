"""Dynamic batching for one engine on one device thread, with a bounded, adaptive wait.

Plan, run, absorb: ``take_batch`` (pure) decides from the queue and the clock how many of the
oldest requests form the next batch, or when to look again; the device thread runs the batch
with ``run_batch(items) -> results`` and resolves each request's future. The rule (Triton's
dynamic batcher, with an adaptive wait):

- a full batch (``max_batch``) goes at once; so does the largest ``preferred_batch_sizes`` entry
  that the queue can fill;
- an urgent request (an end of speech, whose ``final_ms`` the user is waiting on) goes at once;
- otherwise, with ``adaptive`` (the default), a batch that finds the device idle goes at once unless
  a batch-mate is expected within the slack the SLA leaves (``serving/batch_wait.AdaptiveWait``:
  arrival-rate estimate, AIMD on the latencies the caller reports with ``on_latency``), never
  longer than ``batch_timeout_ms``; without it (the fixed rule) the batch waits until its oldest
  request has waited ``batch_timeout_ms``, then goes with what there is.

A batch with an urgent request (an end of speech's final; the decode of a pause, which decides whether
the turn has ended and starts its reply ahead) runs holding ``urgency`` (``serving.urgency``): the LLM's
chat steps wait meanwhile (each at most ``max_yield_s``) rather than halve that pass's speed on shared
cores. The partials during speech share the cores as they come.

Preemption (``preempt``), for an engine that can stop a step midway (``interrupt``, then ``resume``
before the next batch): a running batch is stopped when the work its caller names is no longer wanted
and no other urgent request is in it; its requests fail with ``Interrupted`` and their callers ask again.

A failing ``run_batch`` fails only that batch's requests; the thread keeps serving. The queue is
bounded (``Overloaded`` at submit). Work nobody waits for any more leaves the queue without running:
``drop(match)`` removes a caller's queued requests (their futures are cancelled), and a future
cancelled by its caller is skipped when its batch is formed. A batch already running finishes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ...errors import EdgeAgentError, Overloaded
from ..batch_wait import AdaptiveWait
from ..urgency import URGENT, Urgency

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How big a batch may be, how long the first request may wait for company, the queue bound."""

    max_batch: int = 4
    batch_timeout_ms: float = 80.0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue: int = 64
    adaptive: bool = True  # wait only for an expected batch-mate (AdaptiveWait); False: the fixed timeout


class Stoppable(Protocol):
    """An engine whose running step ``interrupt`` stops midway (any thread: the step raises ``Interrupted``,
    as do its later model calls until ``resume``)."""

    def interrupt(self) -> None: ...

    def resume(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Waiting:
    """What the plan needs to know about one queued request."""

    since_s: float
    urgent: bool = False


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """``take_batch``'s answer: how many to run now, or when to look again."""

    take: int  # how many of the oldest requests run now (0: none)
    wake_at_s: float | None = None  # when to plan again if nothing arrives (None: on arrival only)


def take_batch(
    pending: Sequence[Waiting], now: float, limits: BatchLimits, wait: AdaptiveWait | None = None
) -> BatchPlan:
    """How many of the oldest ``pending`` requests to run now, or when to look again. ``wait``: the
    adaptive rule (it replaces the fixed ``batch_timeout_ms`` wait, which stays its upper bound)."""
    if not pending:
        return BatchPlan(0)
    n = min(len(pending), limits.max_batch)
    if n == limits.max_batch or any(w.urgent for w in pending[:n]):
        return BatchPlan(n)
    preferred = [p for p in limits.preferred_batch_sizes if p <= n]
    if preferred:
        return BatchPlan(max(preferred))
    due = pending[0].since_s + limits.batch_timeout_ms / 1e3
    if now >= due:
        return BatchPlan(n)
    if wait is not None:
        hold = wait.wait_s(now, pending[0].since_s, limits.max_batch - n)
        return BatchPlan(n) if hold <= 0 else BatchPlan(0, min(due, now + hold))
    return BatchPlan(0, due)


class _Request(Generic[T]):
    __slots__ = ("item", "waiting", "future")

    def __init__(self, item: T, waiting: Waiting) -> None:
        self.item, self.waiting = item, waiting
        self.future: Future[object] = Future()


class Batcher(Generic[T, R]):
    """The device thread: gathers requests into batches and runs them one batch at a time."""

    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R]],
        limits: BatchLimits = BatchLimits(),
        *,
        clock: Callable[[], float] = time.monotonic,
        name: str = "batcher",
        urgency: Urgency | None = URGENT,
        stoppable: Stoppable | None = None,
    ) -> None:
        """``urgency``: held while a batch with an urgent request runs (None: never; see the module doc).
        ``stoppable``: the engine ``run_batch`` runs, when it can stop a step midway (``preempt``)."""
        self.run_batch, self.limits, self.clock = run_batch, limits, clock
        self.urgency = urgency
        self.stoppable = stoppable
        self._running: list[_Request[T]] | None = None
        self.preempted = 0  # batches stopped by preempt()
        self._queue: deque[_Request[T]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.batches = 0
        self.batch_sizes: dict[int, int] = {}  # size → how many batches had it
        self.busy_s = 0.0  # time spent inside run_batch
        self.dropped = 0  # requests removed from the queue by drop()
        # the adaptive wait's upper bound is the configured timeout; nothing to adapt without one
        self.wait = (
            AdaptiveWait(limits.batch_timeout_ms / 1e3) if limits.adaptive and limits.batch_timeout_ms > 0 else None
        )

    def start(self) -> Batcher[T, R]:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def submit(self, item: T, urgent: bool = False) -> Future:
        with self._cond:
            if self._stopping:
                raise Overloaded("the batcher is stopping; no new requests")
            if len(self._queue) >= self.limits.max_queue:
                raise Overloaded(
                    f"{len(self._queue)} requests already queued (max_queue {self.limits.max_queue}); try again later"
                )
            req = _Request(item, Waiting(self.clock(), urgent))
            if self.wait is not None:
                self.wait.observe_arrival(req.waiting.since_s)
            self._queue.append(req)
            self._cond.notify_all()
        return req.future

    @property
    def queued(self) -> int:
        return len(self._queue)

    def on_latency(self, ms: float, sla_ms: float) -> None:
        """A latency the caller's SLA governs (any thread): the adaptive wait grows while it is met
        and is cut on a breach. No effect with the fixed rule."""
        if self.wait is not None:
            with self._cond:
                self.wait.on_latency(ms, sla_ms)

    def drop(self, match: Callable[[T], bool]) -> int:
        """Remove the queued (not yet running) requests whose item ``match``es; their futures are
        cancelled. Returns how many were dropped."""
        with self._cond:
            dropped = [r for r in self._queue if match(r.item)]
            if dropped:
                self._queue = deque(r for r in self._queue if not match(r.item))
                self.dropped += len(dropped)
        # outside the lock: a cancelled future runs its callbacks here, and they may submit again
        for r in dropped:
            r.future.cancel()
        return len(dropped)

    def preempt(self, match: Callable[[T], bool]) -> bool:
        """Stop the running batch when it holds an item that ``match``es and every urgent request in it
        matches (another caller's urgent work is never stopped), if the engine can (``interrupt``). True when
        it was stopped: its requests fail with ``Interrupted``."""
        if self.stoppable is None:
            return False
        with self._cond:
            batch = self._running
            if batch is None or not any(match(r.item) for r in batch):
                return False
            if any(r.waiting.urgent and not match(r.item) for r in batch):
                return False
            self.stoppable.interrupt()
            self.preempted += 1
            return True

    def _next_batch(self) -> list[_Request[T]] | None:
        with self._cond:
            while True:
                now = self.clock()
                plan = take_batch([r.waiting for r in self._queue], now, self.limits, self.wait)
                take = plan.take
                if not take and self._stopping:  # draining: nothing waits for company any more
                    if not self._queue:
                        return None
                    take = min(len(self._queue), self.limits.max_batch)
                if take:
                    batch = [self._queue.popleft() for _ in range(take)]
                    # a future its caller cancelled meanwhile is not run (and can no longer be cancelled)
                    batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
                    if batch:
                        self._running = batch
                        if self.stoppable is not None:
                            self.stoppable.resume()  # a preempt() that came after the last batch ended: void
                        return batch
                    continue
                timeout = 0.5 if plan.wake_at_s is None else max(0.0, plan.wake_at_s - now)
                self._cond.wait(timeout)

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            start = time.perf_counter()
            urgent = self.urgency is not None and any(r.waiting.urgent for r in batch)
            try:
                with self.urgency.held() if urgent and self.urgency is not None else nullcontext():
                    results = list(self.run_batch([r.item for r in batch]))
                if len(results) != len(batch):
                    raise EdgeAgentError(f"engine returned {len(results)} results for a batch of {len(batch)}")
            except Exception as exc:  # a failing batch fails its requests, never the device thread
                if not isinstance(exc, EdgeAgentError):
                    log.exception("batch of %d failed", len(batch))
                for r in batch:
                    r.future.set_exception(exc)
                continue
            finally:
                with self._cond:
                    self._running = None
                self.busy_s += time.perf_counter() - start
                self.batches += 1
                self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
            for r, result in zip(batch, results):
                r.future.set_result(result)
