"""One device step at a time, in turns, for the LLM schedulers that share a set of cores.

After a switch to a tier with other weights, the tier left behind finishes the rows it runs (their replies
already started) while the new tier serves everything else: two schedulers, each on its own device thread,
on the same cores. Left to the operating system, their steps run side by side, each at about half speed and
slower still when their thread pools contend: the requests just moved to the new tier waited seconds for
their first tokens while the old tier drained.

The ``StepGate`` lets one step run at a time and hands the cores over in turns: when a step ends, the
scheduler that has waited longest steps next, so a request moved to the new tier waits at most one of the
old tier's steps for its prefill, and the draining rows still advance, one step for each of the new tier's.
The hand-over is decided when a step ends, among the schedulers then waiting, so it does not depend on
which thread the operating system wakes first. A scheduler alone takes the gate at once: a ladder that is
not switching pays one uncontended lock per step.

The gate is shared by the batched schedulers of one ladder: a one-sequence tier on an accelerator and its
spill tier on the CPU run side by side by design, and do not share one.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class StepGate:
    """Device steps one at a time, the longest waiting next (see the module doc)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: Hashable | None = None  # the scheduler whose step runs now
        self._waiting: list[Hashable] = []  # schedulers waiting to step, the longest waiting first
        self.waits = 0  # steps that waited for another scheduler's

    @contextmanager
    def step(self, who: Hashable) -> Iterator[None]:
        """Run one step of ``who`` (a scheduler, stepping from one thread) in the block."""
        with self._cond:
            if self._holder is None:
                self._holder = who
            else:
                self.waits += 1
                self._waiting.append(who)
                self._cond.notify_all()  # ``queued`` callers look again
                self._cond.wait_for(lambda: self._holder is who)
        try:
            yield
        finally:
            with self._cond:
                self._holder = self._waiting.pop(0) if self._waiting else None
                self._cond.notify_all()

    def queued(self, n: int, timeout_s: float | None = None) -> bool:
        """Wait until ``n`` schedulers wait for the gate (False on timeout)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiting) >= n, timeout_s)
