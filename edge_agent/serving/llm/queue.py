"""The requests waiting for a batch row in one scheduler (``LLMScheduler.queue``).

A ladder keeps its waiting requests in the queue of the scheduler that serves: on a switch to a tier with
other weights it moves every request that has not started into the new scheduler's queue at once
(``take_waiting``), so the old tier finishes only the rows it runs; tiers that share weights share the
scheduler, and with it the queue.

Order: requests tagged interactive (a voice turn's) first, in arrival order; then chats a voice turn
preempted (they resume before any chat that has not started); then the other chats, oldest first.
``voice_streams`` counts the voice streams open on the ladder: while one is, chats may use at most
``max_batch - 1`` rows, so a spoken command finds a row free.

All of it is guarded by ``cond`` (a ``threading.Condition``), which the scheduler's device thread waits
on; ``put`` notifies it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol


class Waiter(Protocol):
    """What the queue reads of a waiting request."""

    interactive: bool
    preempted: bool


class WaitQueue:
    """The waiting requests of one ladder (see the module doc). Iteration and ``len`` need ``cond`` held."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._items: deque[Any] = deque()
        self.voice_streams = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def put(self, item: Waiter) -> None:
        """Under ``cond``: queue ``item`` in its place (see the module doc) and wake the scheduler."""
        if item.interactive:
            at = sum(1 for s in self._items if s.interactive)
        elif item.preempted:
            at = sum(1 for s in self._items if s.interactive or s.preempted)
        else:
            self._items.append(item)
            self.cond.notify_all()
            return
        self._items.insert(at, item)
        self.cond.notify_all()

    def popleft(self) -> Any:
        return self._items.popleft()

    def remove(self, item: Any) -> None:
        self._items.remove(item)

    def first_chat(self) -> int:
        """The index of the first request that is not interactive (``len`` when there is none)."""
        return next((i for i, s in enumerate(self._items) if not s.interactive), len(self._items))

    def take_waiting(self) -> list[Any]:
        """Under ``cond``: take out every request that has not started (a preempted one stays: its KV
        belongs to this scheduler's model), in queue order."""
        moving = [s for s in self._items if not s.preempted]
        self._items = deque(s for s in self._items if s.preempted)
        return moving

    def set_voice_streams(self, count: int) -> None:
        with self.cond:
            self.voice_streams = max(0, count)
            self.cond.notify_all()
