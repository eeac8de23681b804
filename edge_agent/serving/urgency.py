"""Voice first on the cores: work a person is waiting on now holds ``Urgency``; background work yields to it.

The LLM tiers and the recogniser run on device threads of their own, and on a CPU they share the same
cores: a Whisper pass that a speaker is waiting on (the decode of a pause, which decides whether their
turn has ended and starts its reply ahead; the final the reply waits for) runs at half speed while chats
decode beside it. So the recogniser holds the process's urgency (``URGENT``) while it runs such a pass
(``held``), and the LLM scheduler, before a step that
serves no voice turn, waits while it is held (``wait_clear``), for at most ``max_yield_s`` per step: chats'
next tokens come a little later, never stop, and the voice turn has the cores. A voice turn's own reply
(an interactive request) never waits.

It also says how much longer the urgent work now running is expected to hold the cores (``expected_left_s``:
the mean of the last holds' lengths, less how long this one has run), which admission counts on the time
a chat's row frees: the chats' decode steps wait that long.

One ``Urgency`` per process (``URGENT``): there is one set of cores. Tests make their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

MAX_YIELD_S = 0.5  # the longest a background step waits for urgent work (then it runs one step)
HOLD_EWMA = 0.25  # weight of the newest hold's length in the expected one


class Urgency:
    """How many urgent passes run now; background work waits while any does (see the module doc)."""

    def __init__(self, max_yield_s: float = MAX_YIELD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._held = 0
        self.max_yield_s = max_yield_s
        self._clock = clock
        self.yielded_s = 0.0  # background time spent waiting, in all (for metrics and tests)
        self._since = 0.0  # when the cores last became held (nested and concurrent holds: one span)
        self._mean_s: float | None = None  # how long a span lasts, lately

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold urgency for the duration of the block (nested and concurrent holds count)."""
        with self._cond:
            if not self._held:
                self._since = self._clock()
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                if not self._held:
                    span = max(0.0, self._clock() - self._since)
                    self._mean_s = span if self._mean_s is None else self._mean_s + HOLD_EWMA * (span - self._mean_s)
                    self._cond.notify_all()

    def expected_left_s(self) -> float:
        """How much longer the urgent work now running is expected to hold the cores: the recent spans' mean
        less this one's age (0 when nothing is held or no span has ended yet). Reads without the lock: the
        scheduler calls it under its own, which ``wait_clear``'s ``until`` takes under this one."""
        held, mean, since = self._held, self._mean_s, self._since
        if not held or mean is None:
            return 0.0
        return max(0.0, mean - (self._clock() - since))

    @property
    def active(self) -> bool:
        with self._cond:
            return self._held > 0

    def wake(self) -> None:
        """Wake the waiters to look at their ``until`` again (e.g. a voice turn's request has arrived)."""
        with self._cond:
            self._cond.notify_all()

    def wait_clear(self, max_s: float | None = None, until: Callable[[], bool] = lambda: False) -> float:
        """Wait while urgency is held, at most ``max_s`` (default ``max_yield_s``) and only until ``until()``
        (checked when ``wake`` is called); the seconds waited (0 when nothing was held)."""
        with self._cond:
            if not self._held or until():
                return 0.0
            start = self._clock()
            limit = self.max_yield_s if max_s is None else max_s
            self._cond.wait_for(lambda: not self._held or until(), timeout=limit)
            waited = max(0.0, self._clock() - start)
            self.yielded_s += waited
            return waited


URGENT = Urgency()  # the process's: the LLM tiers and the recogniser share its cores
