"""The caller's side of one LLM request: the handle it streams from, and what it yields.

``RequestHandle`` is thread-safe: any thread may iterate it, wait for its ``Completion`` or cancel
it; the scheduler's device thread pushes ``TokenEvent`` s and finishes it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...metrics.timing import RequestTiming


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability, its exact bytes, and the most likely alternatives
    (``SamplingParams.logprobs`` of them) as (id, bytes, logprob), most likely first."""

    token_id: int
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One streamed token and the text it completed."""

    token_id: int
    text: str  # new text this token completed (may be empty while a character or stop string is pending)
    time_s: float
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request: its text, tokens, why it ended and its timeline."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # stop | length | deadline | cancelled | repetition
    timing: RequestTiming
    logprobs: tuple[TokenLogprob, ...] = ()  # one per generated token when asked for


class RequestHandle:
    """One request, between the caller (stream tokens, wait for the result, cancel) and the scheduler
    that produces it (``push`` each event, ``finish`` once); ``on_cancel`` wakes the producer."""

    def __init__(self, request_id: int, on_cancel: Callable[[], None] | None = None) -> None:
        self.id = request_id
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.cancelled = False
        # what serves it, set by ``TieredLLM.submit``: the ladder tier, the model folder, the engine it
        # opened (engine:<key> or model:<sha>), and the max_new_tokens granted after the tier's cap
        self.tier: str | None = None
        self.model: str = ""
        self.engine: str | None = None
        self.spill: dict[str, str] | None = None  # served by the spill tier instead: {"from": tier, "reason"}
        self.max_new_tokens: int | None = None
        self._on_cancel = on_cancel
        self._sink: Callable[[TokenEvent | None], None] | None = None
        self._sink_lock = threading.Lock()

    def cancel(self) -> None:
        """Stop the request: a waiting one is dropped, a running one ends at its next token (its
        batch slot is freed then). Safe from any thread, and more than once."""
        first, self.cancelled = not self.cancelled, True
        if first and not self._done.is_set() and self._on_cancel is not None:
            self._on_cancel()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._events.get()
            if isinstance(item, TokenEvent):
                yield item
            elif item is None:
                if self._error is not None:
                    raise self._error
                return

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """Why the request failed (once ``done``), or None."""
        return self._error

    def result(self, timeout_s: float | None = None) -> Completion:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"request {self.id} still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def set_sink(self, sink: Callable[[TokenEvent | None], None]) -> None:
        """Deliver events to ``sink`` instead of the iterator (``None`` ends them; ``result()`` then
        has the outcome), starting with any already queued. Called from the scheduler thread, so
        ``sink`` must only hand the event on (e.g. ``loop.call_soon_threadsafe``)."""
        with self._sink_lock:
            while True:
                try:
                    sink(self._events.get_nowait())
                except queue.Empty:
                    break
            self._sink = sink

    # the producer's side: the scheduler thread
    def push(self, event: TokenEvent | None) -> None:
        with self._sink_lock:
            if self._sink is not None:
                self._sink(event)
            else:
                self._events.put(event)

    def finish(self, completion: Completion | None, error: BaseException | None = None) -> None:
        self._completion, self._error = completion, error
        self._done.set()
        self.push(None)
