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

And it knows the voice turns that are coming: a stream whose speaker is talking now (``speech_started`` ..
``speech_ended``) will want the cores when they stop, for a recogniser pass and, for a voice turn, its reply
(``reply_done`` learns how long replies hold the LLM). ``turns_expected(within_s)`` says how many such turns
are expected to start within that time: each speaker counts in proportion to how much of the rest of their
speech the time covers (the mean utterance less what they have said so far, at least ``MIN_REST_S``). A chat
admitted now whose first token would come after the turn starts would then wait behind it and be refused at
its deadline; counting the expected turns at arrival refuses it at once instead, and a chat that starts at
once (the usual case at low load) is hardly touched.

One ``Urgency`` per process (``URGENT``): there is one set of cores. Tests make their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

MAX_YIELD_S = 0.5  # the longest a background step waits for urgent work (then it runs one step)
HOLD_EWMA = 0.25  # weight of the newest hold's length in the expected one (and of speech, replies)
SPEECH_S = 2.0  # an utterance's expected length until one has ended here
MIN_REST_S = 0.1  # speech heard now ends its turn no sooner than this (the shortest end-of-turn silence)
STALE_SPEECH_S = 120.0  # speech announced this long ago and never ended is no longer counted


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
        self._speaking: dict[Hashable, float] = {}  # stream -> when its current speech started
        self._speech_mean_s: float | None = None  # how long an utterance lasts, lately
        self._reply_mean_s: float | None = None  # how long a voice turn's reply holds the LLM, lately

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
                    self._mean_s = _ewma(self._mean_s, max(0.0, self._clock() - self._since))
                    self._cond.notify_all()

    def expected_left_s(self) -> float:
        """How much longer the urgent work now running is expected to hold the cores: the recent spans' mean
        less this one's age (0 when nothing is held or no span has ended yet). Reads without the lock: the
        scheduler calls it under its own, which ``wait_clear``'s ``until`` takes under this one."""
        held, mean, since = self._held, self._mean_s, self._since
        if not held or mean is None:
            return 0.0
        return max(0.0, mean - (self._clock() - since))

    def speech_started(self, key: Hashable) -> None:
        """``key``'s speaker started talking: a turn will want the cores when they stop."""
        with self._cond:
            self._speaking[key] = self._clock()

    def speech_ended(self, key: Hashable, learn: bool = True) -> None:
        """``key``'s speech ended (``learn``: its length goes into the expected one; not for a stream cut
        short). Ending one that was not started does nothing."""
        with self._cond:
            since = self._speaking.pop(key, None)
            if since is not None and learn:
                self._speech_mean_s = _ewma(self._speech_mean_s, max(0.0, self._clock() - since))

    def reply_done(self, seconds: float) -> None:
        """A voice turn's reply held the LLM for ``seconds`` (its prefill to its last token)."""
        with self._cond:
            self._reply_mean_s = _ewma(self._reply_mean_s, max(0.0, seconds))

    def turn_cost_s(self) -> float:
        """How long a coming turn is expected to hold the cores: a recogniser pass and a reply, as lately."""
        return (self._mean_s or 0.0) + (self._reply_mean_s or 0.0)

    def turns_expected(self, within_s: float) -> float:
        """How many of the coming turns are expected to start within ``within_s`` from now (see the module
        doc). Reads without the lock, as ``expected_left_s``."""
        now, mean = self._clock(), self._speech_mean_s or SPEECH_S
        expected = 0.0
        for since in tuple(self._speaking.values()):
            age = now - since
            if age <= STALE_SPEECH_S:
                expected += min(1.0, max(0.0, within_s) / max(MIN_REST_S, mean - age))
        return expected

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


def _ewma(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + HOLD_EWMA * (sample - mean)


URGENT = Urgency()  # the process's: the LLM tiers and the recogniser share its cores
