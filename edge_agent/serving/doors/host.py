"""What every front door runs on: an asyncio loop on a thread of its own, and mailboxes into it.

- ``LoopThread``: one loop on one thread. ``start(setup, shutdown)`` runs ``setup()`` on the loop (listening:
  a port that is taken fails the start, with the door's own message), then serves until ``stop()``;
  ``shutdown()`` runs on the loop before it closes. The loop advances ``ticks`` every ``TICK_S``: the
  watchdog's sign that nothing blocks it.
- ``Mailbox``: how device threads (the ASR batcher, the LLM scheduler, a voice turn's replier) hand events
  to a loop. ``post`` from any thread, the loop's own included: the item is queued on the loop, behind every
  item posted before it (``call_soon_threadsafe``), and dropped once the loop is closed (nobody reads it
  then). ``put`` on the loop queues at once; ``get`` awaits the next item; ``clear`` drops what is queued.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ...errors import EdgeAgentError

TICK_S = 0.1
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread named ``name`` (see the module doc)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ticks = 0  # advanced by the loop every TICK_S
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(
        self,
        setup: Callable[[], Awaitable[None]],
        shutdown: Callable[[], Awaitable[None]],
        failed: str,
    ) -> None:
        """Run ``setup()`` on a new loop on a new thread and return once it finished (at most
        ``START_TIMEOUT_S``); the loop then serves until ``stop``, and ``shutdown()`` runs on it before it
        closes. A ``setup`` that raises ends the thread: ``EdgeAgentError("<failed>: <why>")``."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(setup())
            except BaseException as exc:  # e.g. the port is taken
                failure.append(exc)
                loop.close()
                ready.set()
                return
            self._tick()
            ready.set()
            loop.run_forever()
            loop.run_until_complete(shutdown())
            loop.close()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        ready.wait(START_TIMEOUT_S)
        if failure:
            raise EdgeAgentError(f"{failed}: {failure[0]}")

    def _tick(self) -> None:
        self.ticks += 1
        assert self.loop is not None
        self.loop.call_later(TICK_S, self._tick)

    def stop(self) -> None:
        """Stop the loop (its ``shutdown`` runs, then it closes) and wait for the thread, at most
        ``STOP_TIMEOUT_S``. A loop already closed, or never started, is left as it is."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed in the meantime
                pass
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)


class Mailbox(Generic[T]):
    """Items for one loop's reader, handed over from any thread (see the module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[T] = asyncio.Queue()

    def post(self, item: T) -> None:
        """Any thread: queue ``item`` on the loop, behind everything posted before it; dropped once the loop
        is closed (the door is stopping: nobody reads)."""
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass

    def put(self, item: T) -> None:
        """On the loop: queue ``item`` now (ahead of posts still on their way to the loop)."""
        self._queue.put_nowait(item)

    async def get(self) -> T:
        """On the loop: the next item, once there is one."""
        return await self._queue.get()

    def clear(self) -> None:
        """On the loop: drop every item queued (not those still on their way)."""
        while not self._queue.empty():
            self._queue.get_nowait()
