"""Continuous batching for one LLM on one device thread.

Each loop turn is plan → run → absorb:
- ``plan_admission`` (pure) decides how many waiting requests to prefill now. With sequences
  already decoding, newcomers join at the next step boundary; on an idle engine the first request
  waits at most ``batch_timeout_ms`` for the batch to reach a preferred size.
- the engine prefills the admitted prompts into the batch (``DecoderLM.join``: one left-padded
  batch, or one slot each for in-place KV buffers), then runs one decode step for every running
  sequence;
- each sequence absorbs its token: sampling, detokenization, stop checks, delivery to its handle.

A failing engine call fails only the requests in that call; the loop keeps serving. The queue is
bounded (``Overloaded`` at submit), waiting is bounded (``DeadlineExceeded``), and a handle can be
cancelled at any time. Handles are thread-safe: any thread may submit, read and cancel.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ...errors import DeadlineExceeded, EdgeAgentError, Overloaded, Unavailable
from ...metrics.timing import RequestTiming, TimingRecorder
from ...models.kv_batch import DecodeBatch
from ...models.kv_slots import SlotCache
from ...models.llm import DecoderLM
from ...models.sampling import Sampler, SamplingParams, find_stop, repeated_too_often
from ...models.tokenizer import StreamDecoder

log = logging.getLogger(__name__)


DEFAULT_PARAMS = SamplingParams()  # frozen: one shared default


@dataclass(frozen=True, slots=True)
class Limits:
    """Batching and admission limits of one scheduler (``plan_admission`` reads them)."""

    max_batch: int = 4
    batch_timeout_ms: float = 80.0
    preferred_batch_sizes: tuple[int, ...] = (2, 4)
    max_queue: int = 64
    queue_timeout_ms: float = 30_000.0


def plan_admission(
    waiting_since: Sequence[float], running: int, now: float, limits: Limits
) -> tuple[int, float | None]:
    """How many of the oldest waiting requests to prefill now, and, if none, when to look again.

    ``waiting_since``: admission times of the queued requests, oldest first.
    """
    free = limits.max_batch - running
    if not waiting_since or free <= 0:
        return 0, None
    n = min(free, len(waiting_since))
    if running > 0 or n == free or n in limits.preferred_batch_sizes:
        return n, None
    due = waiting_since[0] + limits.batch_timeout_ms / 1e3
    return (n, None) if now >= due else (0, due)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One streamed token and the text it completed."""

    token_id: int
    text: str  # new text this token completed (may be empty while a character or stop string is pending)
    time_s: float


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request: its text, tokens, why it ended and its timeline."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # stop | length | deadline | cancelled | repetition
    timing: RequestTiming


class RequestHandle:
    """The caller's side of one request: stream tokens, wait for the result, or cancel."""

    def __init__(self, request_id: int) -> None:
        self.id = request_id
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.cancelled = False
        self.tier: str | None = None  # the ladder tier serving it (``TieredLLM.submit`` sets it)
        self._on_cancel: Callable[[], None] | None = None  # set by the scheduler: wakes its loop

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

    def result(self, timeout_s: float | None = None) -> Completion:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"request {self.id} still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    # called by the scheduler thread
    def _push(self, event: TokenEvent) -> None:
        self._events.put(event)

    def _finish(self, completion: Completion | None, error: BaseException | None = None) -> None:
        self._completion, self._error = completion, error
        self._done.set()
        self._events.put(None)


class _Sequence:
    """Per-request state while it waits or decodes."""

    def __init__(
        self,
        handle: RequestHandle,
        prompt: list[int],
        params: SamplingParams,
        admitted_s: float,
        deadline_s: float | None,
        decoder: StreamDecoder,
        tags: Sequence[str],
        clock: Callable[[], float],
    ) -> None:
        self.handle, self.prompt, self.params = handle, prompt, params
        self.admitted_s = admitted_s
        self.recorder = TimingRecorder(len(prompt), tags, clock=clock, admitted_s=admitted_s)
        self.deadline_s = deadline_s
        self.sampler = Sampler(params)
        self.decoder = decoder
        self.generated: list[int] = []
        self.history = list(prompt)  # prompt + generated, kept incrementally for the sampler
        self.emitted = 0  # characters of decoder text already delivered
        self.finish_reason: str | None = None
        self.final_text: str | None = None  # the text cut at a stop string


class LLMScheduler:
    """Continuous batching of one loaded model on one device thread (see the module doc):
    ``submit`` returns a ``RequestHandle``; each finished request's ``RequestTiming`` goes to
    ``on_finished``; ``stop(timeout_s)`` finishes what was admitted."""

    def __init__(
        self,
        lm: DecoderLM,
        limits: Limits = Limits(),
        on_finished: Callable[[RequestTiming], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lm, self.limits, self.clock = lm, limits, clock
        self.on_finished = on_finished
        self._waiting: deque[_Sequence] = deque()
        self._batch: DecodeBatch[_Sequence] | SlotCache[_Sequence] = lm.new_batch(limits.max_batch)
        self._cond = threading.Condition()
        self._stopping = False
        self._next_id = 0
        self._thread = threading.Thread(target=self._loop, name=f"llm-{lm.ref.name}", daemon=True)
        self.steps = 0  # decode steps run (progress, for the watchdog)

    def start(self) -> LLMScheduler:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop admitting; finish what is queued and running (within ``timeout_s``), then exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running)"""
        return len(self._waiting), len(self._batch)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        deadline_ms: float | None = None,
        tags: Sequence[str] = (),
    ) -> RequestHandle:
        self.lm.check_prompt(prompt_ids, params.max_new_tokens)
        now = self.clock()
        with self._cond:
            if self._stopping:
                raise Unavailable("the agent is shutting down and admits no new requests")
            if len(self._waiting) >= self.limits.max_queue:
                raise Overloaded(f"queue full ({self.limits.max_queue} waiting); retry later")
            self._next_id += 1
            handle = RequestHandle(self._next_id)
            handle._on_cancel = self._wake
            deadline = now + deadline_ms / 1e3 if deadline_ms is not None else None
            self._waiting.append(
                _Sequence(
                    handle, list(prompt_ids), params, now, deadline, StreamDecoder(self.lm.tokenizer), tags, self.clock
                )
            )
            self._cond.notify_all()
        return handle

    def _wake(self) -> None:
        # A cancelled waiter is dropped at once rather than at the loop's next timed look.
        with self._cond:
            self._cond.notify_all()

    # -- the device thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                admitted = self._take_admitted()
                if admitted is None:
                    return
            try:
                if admitted:
                    self._prefill(admitted)
                if len(self._batch):
                    self._decode()
            except Exception as exc:  # a bug here must fail requests, never the device thread
                log.exception("serving loop error")
                rows = self._batch.remove(range(len(self._batch)))
                self._fail(
                    [s for s in rows + admitted if not s.handle._done.is_set()],
                    EdgeAgentError(f"internal serving error: {exc}"),
                )

    def _take_admitted(self) -> list[_Sequence] | None:
        """Under the lock: drop expired/cancelled waiters, then admit or sleep. None = exit."""
        while True:
            now = self.clock()
            for seq in [s for s in self._waiting if s.handle.cancelled or self._expired(s, now)]:
                self._waiting.remove(seq)
                self._reject(seq, now)
            running = len(self._batch)
            n, wake_at = plan_admission([s.admitted_s for s in self._waiting], running, now, self.limits)
            if n or running:
                return [self._waiting.popleft() for _ in range(n)]
            if self._stopping and not self._waiting:
                return None
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            self._cond.wait(timeout if timeout is not None else 0.5)

    def _expired(self, seq: _Sequence, now: float) -> bool:
        waited_ms = (now - seq.admitted_s) * 1e3
        return waited_ms > self.limits.queue_timeout_ms or (seq.deadline_s is not None and now > seq.deadline_s)

    def _reject(self, seq: _Sequence, now: float) -> None:
        if seq.handle.cancelled:
            self._complete(seq, "cancelled")
            return
        timing = seq.recorder.finish()
        seq.handle._finish(
            None,
            DeadlineExceeded(
                f"request {seq.handle.id} waited {(now - timing.admitted_s) * 1e3:.0f} ms in the queue and was "
                f"not started (queue timeout {self.limits.queue_timeout_ms:.0f} ms or its own deadline)"
            ),
        )
        self._report(timing)

    def _prefill(self, seqs: list[_Sequence]) -> None:
        for seq in seqs:
            seq.recorder.mark_scheduled()
        first = len(self._batch)
        try:
            logits = self.lm.join(self._batch, seqs, [s.prompt for s in seqs])
        except EdgeAgentError as exc:
            self._fail(seqs, exc)
            return
        except Exception as exc:  # a runtime bug must not kill the device thread
            log.exception("prefill failed")
            self._fail(seqs, EdgeAgentError(f"prefill failed: {exc}"))
            return
        self._absorb(first, logits)

    def _decode(self) -> None:
        rows = list(self._batch.rows)
        try:
            logits = self.lm.decode(self._batch, [s.generated[-1] for s in rows])
        except Exception as exc:
            if not isinstance(exc, EdgeAgentError):
                log.exception("decode step failed")
                exc = EdgeAgentError(f"decode step failed: {exc}")
            self._batch.remove(range(len(rows)))
            self._fail(rows, exc)
            return
        self.steps += 1
        self._absorb(0, logits)

    def _absorb(self, first: int, logits) -> None:
        """Batch rows ``first…`` take their next token from ``logits`` [n, V]; finished rows leave."""
        now = self.clock()
        finished = []
        for i, seq in enumerate(self._batch.rows[first:], start=first):
            token = seq.sampler.choose(logits[i - first], seq.history)
            seq.generated.append(token)
            seq.history.append(token)
            seq.recorder.mark_token()
            reason = self._finish_reason(seq, token, now)
            self._deliver(seq, token, final=reason is not None)
            reason = seq.finish_reason or reason  # delivery may have found a stop string
            if reason:
                seq.finish_reason = reason
                finished.append(i)
        for seq in self._batch.remove(finished):
            self._complete(seq, seq.finish_reason or "length")

    def _finish_reason(self, seq: _Sequence, token: int, now: float) -> str | None:
        p = seq.params
        if seq.handle.cancelled:
            return "cancelled"
        if not p.ignore_eos and token in self.lm.contract.eos_ids:
            return "stop"
        if len(seq.generated) >= p.max_new_tokens:
            return "length"
        if repeated_too_often(seq.generated, p.max_repeats):
            return "repetition"
        if seq.deadline_s is not None and now >= seq.deadline_s:
            return "deadline"
        return None

    def _deliver(self, seq: _Sequence, token: int, final: bool) -> None:
        seq.decoder.push(token)
        text = seq.decoder.text
        stops = seq.params.stop
        if stops:
            cut = find_stop(text, stops, seq.emitted)
            if cut is not None:
                text, final = text[:cut], True
                seq.finish_reason = "stop"
        # Hold back what could still become a stop string or a split character.
        hold = 0 if final else max((len(s) - 1 for s in stops), default=0)
        safe = max(seq.emitted, len(text) - hold)
        if text.endswith("\ufffd") and not final:
            safe = min(safe, len(text) - 1)
        piece = text[seq.emitted : safe]
        seq.emitted = max(seq.emitted, safe)
        seq.handle._push(TokenEvent(token, piece, self.clock()))
        if final and stops:
            seq.final_text = text

    def _complete(self, seq: _Sequence, reason: str) -> None:
        timing = seq.recorder.finish()
        text = seq.final_text if seq.final_text is not None else seq.decoder.text
        seq.handle._finish(Completion(text, tuple(seq.generated), reason, timing))
        self._report(timing)

    def _fail(self, seqs: list[_Sequence], exc: BaseException) -> None:
        for seq in seqs:
            timing = seq.recorder.finish()
            seq.handle._finish(None, exc)
            self._report(timing, error=True)

    def _report(self, timing: RequestTiming, error: bool = False) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(timing)
            except Exception:  # metrics must never stop serving
                log.exception("on_finished callback failed")
