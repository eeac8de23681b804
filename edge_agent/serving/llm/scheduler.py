"""Continuous batching for one LLM on one device thread.

Each loop turn is plan → run → absorb:
- ``plan_admission`` (pure) decides how many waiting requests to prefill now, the oldest first,
  except that a request tagged ``INTERACTIVE`` (a voice turn's) queues ahead of untagged ones. With sequences
  already decoding, newcomers join at the next step boundary; on an idle engine a request waits
  for a batch-mate only when one is expected soon enough (``batch_wait.AdaptiveWait``: the arrival
  rate, and a wait that grows while TTFT meets ``Limits.sla_ms`` and halves on a breach), never
  longer than ``batch_timeout_ms``. A lone request on an idle device starts at once.
- the engine prefills the admitted prompts into the batch (``DecoderLM.join``: one left-padded
  batch, or one slot each for in-place KV buffers), at most ``Limits.prefill_chunk_tokens`` prompt
  tokens a turn while others decode (``prefill.Prefills``: a long prompt enters over several turns),
  then runs one decode step for every running sequence; a prompt whose start was prefilled before
  takes that KV from the prefix cache (``models.prefix_cache``, ``Limits.prefix_cache_mb``) and prefills
  only the rest;
- each sequence absorbs its token: sampling, detokenization, stop checks, delivery to its handle.

A request with an output format (``SamplingParams.grammar``) owns a ``grammar.Constraint``: its mask
of allowed tokens for the next step is computed on a helper thread while the engine runs the step
(llguidance and the runtime both release the GIL), then applied to its row before the pick.

A failing engine call fails only the requests in that call, and an output format that breaks while
its row generates (``grammar.FormatError``) fails only that row; the loop keeps serving. One that
cannot start is refused at ``submit``, before admission. Either costs one short log line, at most
one per ``LOG_EVERY_S`` per kind (``LogLimiter``). The queue is
bounded (``Overloaded`` at submit), waiting is bounded (``DeadlineExceeded``; a request's own start
deadline, ``start_by_ms``, ends as ``Overloaded``: it was never started), and a handle can be
cancelled at any time. Handles are thread-safe: any thread may submit, read and cancel.

The waiting requests live in a ``queue.WaitQueue`` (its ladder moves them to another tier's scheduler on
a switch). **Voice first**: while the queue counts an
open voice stream, requests that are not interactive use at most ``max_batch - 1`` rows; when an
interactive request waits and no row is free, the running request that is not interactive with the
most tokens left is preempted: its KV is copied out, it waits ahead of every chat that has not
started, and it resumes from that KV (only its pending token is run again), its output unchanged. A
waiting chat predicted to miss its start deadline (admitted on a prediction that a voice turn or slower
steps then broke) starts at the next step boundary the same way: in a free row, or in the row of the
running chat with the most tokens left that never gave its row up (once at most: a chat is never starved);
with no row to take it is refused then (``start_deadline``). A
warm-up (``warmup`` tag) takes only a free row: it never waits for one. The device thread measures its
decode steps and prefills (``rates``, ``serving.tiers.admission.Rates``), and ``predict_ttft_ms`` says when a
request arriving now would have its first token. With ``Limits.voice_alone`` a voice turn's rows decode by
themselves and the chats' rows stand still meanwhile, so a chat's prediction counts the running voice
reply's expected tokens, and those of each voice turn waiting, on every chat row's time to free; and the
chats' steps wait while a recogniser pass holds ``urgency``, so it counts that pass's expected rest too.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ...errors import ConfigError, DeadlineExceeded, EdgeAgentError, Overloaded, Unavailable
from ...logsetup import LogLimiter
from ...metrics.timing import RequestTiming, TimingRecorder
from ...metrics.window import WARMUP
from ...models.grammar import Constraint, FormatError
from ...models.llm import DecoderLM, KvBatch
from ...models.llm_contract import kv_bytes_per_token
from ...models.prefix_cache import PrefixCache, PrefixStats
from ...models.sampling import Sampler, SamplingParams, find_stop, logprobs_of, repeated_too_often
from ...models.tokenizer import StreamDecoder
from ..batch_wait import AdaptiveWait
from ..tiers.admission import Lateness, Rates, Snapshot, Work, predict_starts, predict_ttft_ms, prefill_ms
from ..urgency import URGENT, Urgency
from .admission import INTERACTIVE, Limits, plan_admission
from .handle import Completion, RequestHandle, TokenEvent, TokenLogprob
from .prefill import Prefills, prefill_deadline, prefill_error
from .queue import WaitQueue
from .step_gate import StepGate

log = logging.getLogger(__name__)
WATCH_S = 0.05  # the deadline watcher looks at least this often (a waiter's start deadline wakes it sooner)


DEFAULT_PARAMS = SamplingParams()  # frozen: one shared default
DEFAULT_LIMITS = Limits()
SEED_PROMPT_TOKENS = 64  # the prefill timed at load to seed admission's rates (over PREFILL_MIN_TOKENS)
CLOSING_MARGIN = 24  # constrained output: prefer closing tokens once this few tokens are left
CLOSING_REPEATS = 6  # or once one token came this many times in a row


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
        constraint: Constraint | None = None,
        start_by_s: float | None = None,
    ) -> None:
        self.handle, self.prompt, self.params = handle, prompt, params
        self.constraint = constraint
        self.logprobs: list[TokenLogprob] = []
        self.admitted_s = admitted_s
        self.tags = tuple(tags)
        self.interactive = INTERACTIVE in tags  # queues ahead of requests that are not
        self.warmup = WARMUP in tags  # takes a free row or none
        self.recorder = TimingRecorder(len(prompt), tags, clock=clock, admitted_s=admitted_s)
        self.deadline_s = deadline_s
        self.start_by_s = start_by_s  # refused (Overloaded) if not started by then
        self.predicted_first_s: float | None = None  # when admission predicted its first token (Lateness)
        self.preempted = False  # it ran, gave its row up (to a voice turn or a late chat); once is its share
        self.rescue = False  # waiting, predicted to miss its start deadline: takes a running chat's row
        self.resume: tuple[int, dict[str, np.ndarray]] | None = None  # (tokens, their KV) it resumes from
        self.lm: DecoderLM | None = None  # the model it was prepared for (ids, format, decoder)
        self.source: object = None  # what its ladder needs to prepare it again for another model
        self.sampler = Sampler(params)
        self.decoder = decoder
        self.generated: list[int] = []
        self.steps = 0  # the tokens of ``generated`` it picked (one a step), not those its format forced
        self.feed: list[int] = []  # what the next decode step takes: the last token, and any its format forced
        self.history = list(prompt)  # prompt + generated, kept incrementally for the sampler
        self.emitted = 0  # characters of decoder text already delivered
        self.finish_reason: str | None = None
        self.final_text: str | None = None  # the text cut at a stop string


def _closing(seq: _Sequence) -> bool:
    """Whether a constrained row should now bring its output to an end: its token budget is nearly
    spent, or it repeats one token (a digit or a letter forever: what a confused model does inside a
    number or a string). Its next picks then prefer tokens that close a value, where the grammar
    allows one, so the output still completes and parses."""
    left = seq.params.max_new_tokens - len(seq.generated)
    return left <= CLOSING_MARGIN or repeated_too_often(seq.generated, CLOSING_REPEATS)


class LLMScheduler:
    """Continuous batching of one loaded model on one device thread (see the module doc):
    ``submit`` returns a ``RequestHandle``; each finished request's ``RequestTiming`` goes to
    ``on_finished``; ``stop(timeout_s)`` finishes what was admitted."""

    def __init__(
        self,
        lm: DecoderLM,
        limits: Limits = DEFAULT_LIMITS,
        on_finished: Callable[[RequestTiming], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rows: int | None = None,
        urgency: Urgency | None = URGENT,
        gate: StepGate | None = None,
    ) -> None:
        """``rows``: the batch places to allocate when more than ``limits.max_batch`` (tiers sharing this model
        with larger batches); ``urgency``: what a step that serves no voice turn yields to (None: nothing);
        ``gate``: shared with the other schedulers on the same cores, one step at a time (``step_gate``)."""
        if lm.max_rows is not None and limits.max_batch > lm.max_rows:  # a stateful model: one sequence
            limits = replace(limits, max_batch=lm.max_rows, preferred_batch_sizes=(lm.max_rows,))
        self.lm, self.limits, self.clock = lm, limits, clock
        self.urgency = urgency
        self.gate = gate or StepGate()
        self.on_finished = on_finished
        self.on_preempted: Callable[[], None] | None = None  # told of each preemption (metrics)
        self.sla_ms: Callable[[], float] = lambda: self.limits.sla_ms  # the SLA in force, read at each use
        self.queue = WaitQueue()
        self.capacity = lm.max_rows or max(limits.max_batch, rows or 0)
        self._batch: KvBatch = lm.new_batch(self.capacity)
        lm.warm_slots(self._batch)  # here, on the loading thread, not in the first requests' prefills
        self.prefix_cache = _prefix_cache(lm, limits)
        self._prefills: Prefills[_Sequence] = Prefills(
            lm, limits.prefill_chunk_tokens, limits.prefill_together, self.prefix_cache
        )  # admitted, prompt not all in
        self._cond = self.queue.cond
        self._stopping = False
        self._next_id = 0
        self._thread = threading.Thread(target=self._loop, name=f"llm-{lm.ref.name}", daemon=True)
        # refuses waiters past (or predicted past) their start deadline while the device thread is in a step
        self._watcher = threading.Thread(target=self._watch, name=f"llm-{lm.ref.name}-deadlines", daemon=True)
        self._masker: ThreadPoolExecutor | None = None  # output-format masks, made while the engine runs
        timeout_s = limits.batch_timeout_ms / 1e3
        self._wait = AdaptiveWait(timeout_s) if limits.adaptive and timeout_s > 0 else None
        # a flood of bad formats costs a line per period, not per request
        self._limited = LogLimiter(clock=clock, logger=log)
        self.steps = 0  # decode steps run (progress, for the watchdog)
        self.rates = Rates()  # written by the device thread under the queue's lock
        self.lateness = Lateness()  # admitted chats' first tokens against their predictions, likewise
        self._seed_rates()
        self.preemptions = 0

    def _seed_rates(self) -> None:
        """Time one prefill of ``SEED_PROMPT_TOKENS`` and one decode step into the empty batch, here on the
        loading thread, and seed the admission rates with them: the first requests after a load are then
        judged on this model's speed. Timed on the wall clock (the serving clock may be a test's); a model
        that cannot run it (a stateful one with a shorter prompt limit) starts unseeded."""
        row, prompt = object(), [1 + i % 64 for i in range(SEED_PROMPT_TOKENS)]
        try:
            start = time.perf_counter()
            self.lm.join(self._batch, [row], [prompt], reach=[SEED_PROMPT_TOKENS + 1])
            prefilled = time.perf_counter()
            self.lm.decode(self._batch, [prompt[0]])
            stepped = time.perf_counter()
        except Exception as exc:  # best effort: requests measure the rates anyway
            log.debug("%s: rates not seeded at load: %s", self.lm.ref.name, exc)
            return
        finally:
            self._batch.remove(range(len(self._batch)))
        step_ms, prefill_ms = (stepped - prefilled) * 1e3, (prefilled - start) * 1e3
        self.rates.seed(step_ms, SEED_PROMPT_TOKENS, prefill_ms, self.clock())

    def start(self) -> LLMScheduler:
        self._thread.start()
        self._watcher.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop admitting; finish what is queued and running (within ``timeout_s``), then exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._watcher.join(1.0)
        if self._masker is not None:
            self._masker.shutdown(wait=False)

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters (None: this model runs without one)."""
        return None if self.prefix_cache is None else self.prefix_cache.stats

    @property
    def _waiting(self) -> WaitQueue:
        return self.queue

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running); a sequence whose prompt is being prefilled is running"""
        return len(self._waiting), len(self._batch) + len(self._prefills)

    def chat_rows(self) -> int:
        """The rows requests that are not interactive may use now (one fewer while a voice stream is open)."""
        rows = self.limits.max_batch
        return rows - 1 if self.queue.voice_streams and rows > 1 else rows

    def free_rows(self) -> int:
        """Rows no sequence holds or waits for now (a warm-up takes one of these or none)."""
        with self._cond:
            return self.limits.max_batch - len(self._batch) - len(self._prefills) - len(self._waiting)

    def predict_ttft_ms(
        self, prompt_tokens: int, interactive: bool = False, now: float | None = None, rows: int | None = None
    ) -> float | None:
        """When a request of ``prompt_tokens`` submitted now would have its first token
        (``serving.tiers.admission.predict_ttft_ms`` over what runs and waits here); None while no rates are known.
        ``rows``: the batch size to predict with, when another than the current limits' (a lighter tier's)."""
        now = self.clock() if now is None else now
        with self._cond:
            view = self._view(now, interactive, rows)
        if view is None:
            return None
        running, ahead, max_rows, rates = view
        predicted = predict_ttft_ms(running, [w for _, w in ahead], prompt_tokens, max_rows, rates)
        if not interactive and self.urgency is not None:
            # a voice turn that starts before this chat's first token holds the cores first: the speakers
            # talking now, each in proportion to how likely their turn starts that soon
            turns = self.urgency.turns_expected(predicted / 1e3)
            predicted += turns * self.urgency.turn_cost_s() * 1e3
        return predicted

    def lateness_ms(self, budget_ms: float, now: float | None = None, arriving_ms: float | None = None) -> float:
        """The margin admission adds to a prediction here for requests of ``budget_ms``: how late admitted chats'
        first tokens came lately, against what arrivals were predicted (``serving.tiers.admission.Lateness``).
        ``arriving_ms``: the prediction of a chat arriving ``now``, counted among those arrivals first."""
        now = self.clock() if now is None else now
        with self._cond:
            if arriving_ms is not None:
                self.lateness.arrived(arriving_ms, now)
            return self.lateness.margin_ms(now, budget_ms)

    def prefill_ms(self, prompt_tokens: int, now: float | None = None) -> tuple[float, float]:
        """(the expected prefill of ``prompt_tokens``, a decode step) from the measured rates (0s while none
        are known)."""
        now = self.clock() if now is None else now
        with self._cond:
            rates = self.rates.snapshot(now)
        return (prefill_ms(prompt_tokens, rates), rates.step_ms) if rates is not None else (0.0, 0.0)

    def _view(
        self, now: float, interactive: bool = False, rows: int | None = None
    ) -> tuple[list[float], list[tuple[_Sequence, Work]], int, Snapshot] | None:
        """Under the lock: what a prediction for a request of this class reads: the tokens each running
        sequence has left, the waiting ones ahead (each with its work), the rows the class may use, the
        rates; None while no rates are known."""
        rates = self.rates.snapshot(now)
        if rates is None:
            return None
        waiting = [s for s in self._waiting if s.interactive or not interactive]
        batch = list(self._batch.rows)
        prefilling = self._prefills.pending()
        max_rows = self.limits.max_batch if interactive else self.chat_rows()
        if rows is not None:
            max_rows = rows - (self.limits.max_batch - max_rows)
        if interactive:  # it preempts a chat if it must: only voice turns and prefills hold it back
            batch = [s for s in batch if s.interactive]
        steps_per_token = rates.prefill_ms_per_token / rates.step_ms if rates.step_ms > 0 else 0.0  # a coarse clock
        holders = [(s, rates.expected_new(s.params.max_new_tokens, s.steps, s.interactive)) for s in batch]
        holders += [
            (s, 1 + left * steps_per_token + rates.expected_new(s.params.max_new_tokens, 0, s.interactive))
            for s, left in prefilling
        ]
        ahead = [
            (s, Work(_to_prefill(s), rates.expected_new(s.params.max_new_tokens, s.steps, s.interactive)))
            for s in waiting
        ]
        stall = 0.0
        if not interactive and self.limits.voice_alone:
            # a voice turn's rows decode alone: the chats' rows stand still until its reply is done, and a
            # waiting voice turn's reply comes first too
            stall = max((left for s, left in holders if s.interactive and not s.warmup), default=0.0)
            stall += sum(w.new_tokens for s, w in ahead if s.interactive and not s.warmup)
        if not interactive and self.urgency is not None and rates.step_ms > 0:
            # and the chats' steps wait while a recogniser pass a speaker waits on holds the cores
            stall += self.urgency.expected_left_s() * 1e3 / rates.step_ms
        running = [left + (0.0 if s.interactive else stall) for s, left in holders]
        return running, ahead, max_rows, rates

    def _late_to_start(self, now: float) -> list[tuple[_Sequence, float]]:
        """Under the lock: the waiting chats now predicted to start more than a step after their start
        deadline (something changed since they were admitted: slower steps, a voice turn ahead), each with
        how late, so they are refused now rather than at their deadline."""
        if not any(s.start_by_s is not None for s in self._waiting):
            return []
        view = self._view(now, rows=self.capacity)  # as many rows as any tier sharing this model: no false alarm
        if view is None:
            return []
        running, ahead, max_rows, rates = view
        starts = predict_starts(running, [w for _, w in ahead], max_rows, rates)
        late = []
        for (seq, _), start_ms in zip(ahead, starts):
            if seq.start_by_s is None or seq.interactive or seq.preempted:
                continue
            excess_ms = (now + start_ms / 1e3 - seq.start_by_s) * 1e3
            if excess_ms > rates.step_ms:
                late.append((seq, excess_ms))
        return late

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        deadline_ms: float | None = None,
        tags: Sequence[str] = (),
        start_by_ms: float | None = None,
    ) -> RequestHandle:
        """Queue a request: ``deadline_ms`` ends it wherever it is (finish reason ``deadline``, or
        ``DeadlineExceeded`` before it started); ``start_by_ms`` refuses it (``Overloaded``) if it has not
        started by then."""
        return self.enqueue(self.prepare(prompt_ids, params, deadline_ms, tags, start_by_ms))

    def prepare(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        deadline_ms: float | None = None,
        tags: Sequence[str] = (),
        start_by_ms: float | None = None,
        handle: RequestHandle | None = None,
    ) -> _Sequence:
        """A request made ready for this model (checked, its output format compiled) but not yet queued
        (``enqueue``); ``handle``: the one it keeps when prepared again for another model."""
        self.lm.check_prompt(prompt_ids, params.max_new_tokens)
        # Compiling the output format and its first mask happens here, on the caller's thread, never on
        # the device thread; a format that cannot start is refused before it could join a batch.
        try:
            constraint = self.lm.token_vocab.constraint(params.grammar) if params.grammar else None
        except FormatError as exc:
            self._limited(logging.WARNING, "format_refused", "%s: output format refused: %s", self.lm.ref.name, exc)
            raise
        now = self.clock()
        if handle is None:
            with self._cond:
                self._next_id += 1
                handle = RequestHandle(self._next_id, on_cancel=self._wake)
        seq = _Sequence(
            handle,
            list(prompt_ids),
            params,
            now,
            now + deadline_ms / 1e3 if deadline_ms is not None else None,
            StreamDecoder(self.lm.tokenizer),
            tags,
            self.clock,
            constraint,
            now + start_by_ms / 1e3 if start_by_ms is not None else None,
        )
        seq.lm = self.lm
        return seq

    def enqueue(self, seq: _Sequence) -> RequestHandle:
        """Queue a prepared request (``prepare``) in its place: interactive ones ahead of the rest."""
        with self._cond:
            if self._stopping:
                raise Unavailable("the agent is shutting down and admits no new requests", reason="draining")
            if len(self.queue) >= self.limits.max_queue:
                raise Overloaded(f"queue full ({self.limits.max_queue} waiting); retry later")
            if self._wait is not None:
                self._wait.observe_arrival(seq.admitted_s)
            self.queue.put(seq)
        if seq.interactive and self.urgency is not None:
            self.urgency.wake()  # a chat step yielding to a pass: the voice turn's request goes first
        return seq.handle

    def _wake(self) -> None:
        # A cancelled waiter is dropped at once rather than at the loop's next timed look.
        with self._cond:
            self._cond.notify_all()

    # -- the device thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._take_admitted():
                    return
            try:
                if self.urgency is not None and not len(self._prefills) and not self._serves_voice():
                    # a voice turn's pass has the cores (serving.urgency), until a voice turn's request comes;
                    # never before a prefill: a chat's first token is what the SLA is on, its next ones are not
                    self.urgency.wait_clear(until=self._voice_waiting)
                with self.gate.step(self):
                    if len(self._prefills):
                        self._prefill()
                    if len(self._batch):
                        self._decode()
            except Exception as exc:  # a bug here must fail requests, never the device thread
                log.exception("serving loop error")
                rows = self._batch.remove(range(len(self._batch))) + self._prefills.drop(self._batch)
                self._fail([s for s in rows if not s.handle.done], EdgeAgentError(f"internal serving error: {exc}"))

    def _voice_waiting(self) -> bool:
        """Whether a voice turn's request (not a warm-up) waits; read while a chat step yields."""
        with self._cond:
            return any(s.interactive and not s.warmup for s in self._waiting)

    def _serves_voice(self) -> bool:
        """Whether a voice turn (an interactive request) is running or being prefilled: its steps never wait."""
        return any(s.interactive for s in self._batch.rows) or any(s.interactive for s, _ in self._prefills.pending())

    def _take_admitted(self) -> bool:
        """Under the lock: drop expired/cancelled waiters, make room for a voice turn, then admit (to the
        prefills) or sleep. False = exit."""
        while True:
            waiting = self._waiting
            if not waiting and (len(self._batch) or len(self._prefills)):
                return True  # nothing to admit: back to the running sequences at once
            now = self.clock()
            self._refuse_overdue(now)
            self._preempt_for_voice()
            self._rescue_late()
            running = len(self._batch) + len(self._prefills)
            n, wake_at = plan_admission([s.admitted_s for s in waiting], running, now, self.limits, self._wait)
            n = self._within_chat_rows(waiting, n, running)
            if n or running:
                self._start([waiting.popleft() for _ in range(n)])
                return True
            if self._stopping and not waiting:
                return False
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            self._cond.wait(timeout if timeout is not None else 0.5)

    def _start(self, admitted: list[_Sequence]) -> None:
        """Under the lock: ``admitted`` go to the prefills (a preempted one from the KV it gave up)."""
        self._prefills.add(
            admitted,
            [s.history if s.resume else s.prompt for s in admitted],
            [len(s.prompt) + s.params.max_new_tokens for s in admitted],
            [s.resume for s in admitted],
        )
        for seq in admitted:
            seq.resume = None

    def _refuse_overdue(self, now: float) -> None:
        """Under the lock: drop cancelled waiters and refuse those past their deadlines or predicted to start
        past them (the device thread before each admission, the watcher between its steps)."""
        waiting = self._waiting
        running = len(self._batch) + len(self._prefills)
        for seq in [s for s in waiting if s.handle.cancelled or self._expired(s, now, running=running)]:
            waiting.remove(seq)
            self._reject(seq, now)
        late = self._late_to_start(now)
        victims = len(self._victims()) - sum(1 for s in waiting if s.rescue) if late else 0
        for seq, excess_ms in late:
            if seq.rescue:
                continue  # its row is on its way: taken at the device thread's next step boundary
            if victims > 0:
                seq.rescue, victims = True, victims - 1
                continue
            waiting.remove(seq)
            self._refuse_late(seq, now, excess_ms)

    def _watch(self) -> None:
        """The watcher thread: a device step (or a chat step yielding to the recogniser) can last longer than
        a waiting chat's budget; its refusal must not wait for the step to end. Wakes at the next start
        deadline, at least every ``WATCH_S`` while requests wait, and sleeps while none does."""
        with self._cond:
            while not (self._stopping and not self._waiting):
                now = self.clock()
                if self._waiting:
                    self._refuse_overdue(now)
                due = [s.start_by_s for s in self._waiting if s.start_by_s is not None]
                if due:
                    self._cond.wait(max(0.001, min(WATCH_S, min(due) - now)))
                else:  # nothing to watch: an idle daemon sleeps until a request is queued (put notifies)
                    self._cond.wait(WATCH_S if self._waiting else None)

    def _within_chat_rows(self, waiting: WaitQueue, n: int, running: int) -> int:
        """Of the ``n`` oldest waiters planned in, how many may start: chats only within ``chat_rows``."""
        cap = self.chat_rows()
        taken = 0
        for seq in list(waiting)[:n]:
            if not seq.interactive and running + taken >= cap:
                break
            taken += 1
        return taken

    def _preempt_for_voice(self) -> None:
        """Under the lock: an interactive request (not a warm-up) waits first and no row is free: the chat
        with the most tokens left gives its row up (see the module doc)."""
        waiting = self._waiting
        if not waiting:
            return
        head = next(iter(waiting))
        if not head.interactive or head.warmup:
            return
        if len(self._batch) + len(self._prefills) < self.limits.max_batch:
            return
        self._preempt(self._victims(voice=True))

    def _rescue_late(self) -> None:
        """Under the lock, at a step boundary: each waiting chat marked for rescue (predicted to miss its start
        deadline, ``_refuse_overdue``) starts now, in a free row or in the row of the running chat with the
        most tokens left that never gave its row up (see the module doc): a chat admitted on a prediction
        that a voice turn or slower steps then broke is served on time instead of refused after waiting."""
        for seq in [s for s in self._waiting if s.rescue]:
            if len(self._batch) + len(self._prefills) >= self.chat_rows() and not self._preempt(self._victims()):
                seq.rescue = False  # no row to take after all: its deadline decides
                continue
            self._waiting.remove(seq)
            seq.rescue = False
            self._start([seq])

    def _victims(self, voice: bool = False) -> list[tuple[int, _Sequence]]:
        """Under the lock: the running chats that may give their row up (a one-sequence model's KV lives inside
        the runtime: none): for a voice turn any, for a late chat those that never gave theirs up."""
        if self.lm.max_rows is not None or getattr(self._batch, "row_kv", None) is None:
            return []
        rows = enumerate(self._batch.rows)
        return [(i, s) for i, s in rows if not s.interactive and not s.handle.done and (voice or not s.preempted)]

    def _preempt(self, chats: list[tuple[int, _Sequence]]) -> bool:
        """Under the lock: the chat of ``chats`` with the most tokens left gives its row up, its KV copied out
        (False: none to preempt)."""
        if not chats:
            return False
        index, victim = max(chats, key=lambda c: c[1].params.max_new_tokens - len(c[1].generated))
        row_kv = self._batch.row_kv  # type: ignore[union-attr]  # _victims checked it
        tokens = len(victim.history) - len(victim.feed)  # what its cache holds: the pending tokens are not in
        kv = {name: np.array(a[None]) for name, a in row_kv(index, tokens).items()}
        self._batch.remove([index])
        victim.resume, victim.preempted = (tokens, kv), True
        self.queue.put(victim)
        self.preemptions += 1
        if self.on_preempted is not None:
            self.on_preempted()
        return True

    def _expired(self, seq: _Sequence, now: float, waiting: bool = True, running: int | None = None) -> bool:
        if seq.deadline_s is not None and now > seq.deadline_s:
            return True
        if not waiting or seq.preempted:  # started once: only its own deadline ends it
            return False
        if seq.warmup and running is not None and running >= self.limits.max_batch:
            return True  # a warm-up takes a free row or none
        late = seq.start_by_s is not None and now > seq.start_by_s
        return late or (now - seq.admitted_s) * 1e3 > self.limits.queue_timeout_ms

    def _reject(self, seq: _Sequence, now: float) -> None:
        if seq.handle.cancelled:
            self._complete(seq, "cancelled")
            return
        timing = seq.recorder.finish()
        self._report(timing)
        waited_ms = (now - timing.admitted_s) * 1e3
        error: EdgeAgentError
        if (seq.deadline_s is not None and now > seq.deadline_s) or seq.preempted:
            error = DeadlineExceeded(f"request {seq.handle.id} reached its deadline after waiting {waited_ms:.0f} ms")
        elif seq.warmup and not (seq.start_by_s is not None and now > seq.start_by_s):
            error = Overloaded("no free row for a warm-up", reason="warmup")
        elif seq.start_by_s is not None and now > seq.start_by_s:
            self._missed_start(seq, now)
            error = Overloaded(
                f"overloaded: request {seq.handle.id} could not start within its "
                f"{(seq.start_by_s - seq.admitted_s) * 1e3:.0f} ms budget; retry shortly",
                retry_after_s=1.0,
                reason="start_deadline",
            )
        else:
            error = DeadlineExceeded(
                f"request {seq.handle.id} waited {waited_ms:.0f} ms in the queue and was "
                f"not started (queue timeout {self.limits.queue_timeout_ms:.0f} ms)"
            )
        seq.handle.finish(None, error)

    def _missed_start(self, seq: _Sequence, now: float, excess_ms: float = 0.0) -> None:
        """Under the lock: a chat refused for its start deadline never has a first token, so its lateness is
        counted at its least (a start at the deadline, or ``excess_ms`` after it, then its prefill): admission
        learns from the chats it let wait too long as from those it served late, not only from the latter."""
        if seq.predicted_first_s is None or seq.start_by_s is None:
            return
        rates = self.rates.snapshot(now)
        prefill_s = prefill_ms(len(seq.prompt), rates) / 1e3 if rates is not None else 0.0
        self.lateness.observe(seq.predicted_first_s, max(now, seq.start_by_s) + excess_ms / 1e3 + prefill_s)
        seq.predicted_first_s = None

    def _refuse_late(self, seq: _Sequence, now: float, excess_ms: float) -> None:
        """A waiting chat predicted to start after its start deadline: refused now (``start_deadline``)."""
        self._missed_start(seq, now, excess_ms)
        timing = seq.recorder.finish()
        self._report(timing)
        budget_ms = (seq.start_by_s - seq.admitted_s) * 1e3 if seq.start_by_s is not None else 0.0
        seq.handle.finish(
            None,
            Overloaded(
                f"overloaded: request {seq.handle.id} is now predicted to start {excess_ms:.0f} ms after its "
                f"{budget_ms:.0f} ms budget allows; retry later",
                retry_after_s=max(1.0, math.ceil(excess_ms / 1e3)),
                reason="start_deadline",
            ),
        )

    def _prefill(self) -> None:
        """This turn's share of the admitted prompts (``prefill.plan_chunks``); those complete join the batch
        with their first token. A sequence cancelled or past its deadline part-way leaves, freeing its cache."""
        now = self.clock()
        for seq in self._prefills.drop(self._batch, lambda s: s.handle.cancelled or self._expired(s, now, False)):
            if seq.handle.cancelled:
                self._complete(seq, "cancelled")
            else:
                self._fail([seq], prefill_deadline(seq.handle.id))
        decoding = len(self._batch)
        plan = self._prefills.plan(decoding)
        for seq, starts, _, cached in plan:
            if starts and not seq.generated:  # a preempted one resuming was scheduled once
                seq.recorder.mark_scheduled()
                seq.recorder.mark_cached(cached)
        joining = [seq for seq, _, completes, _ in plan if completes]
        masks = dict(zip(map(id, joining), self._start_masks(joining)))

        def joined(first: int, logits: np.ndarray) -> None:  # their first tokens stream before the next prefill
            self._absorb(first, logits, [masks[id(s)] for s in self._batch.rows[first:]])

        before = self._prefills.tokens_left()
        start = self.clock()
        failed = self._prefills.run(self._batch, decoding, joined)
        if not failed:
            with self._cond:
                self.rates.prefill(before - self._prefills.tokens_left(), (self.clock() - start) * 1e3, self.clock())
        for seqs, exc in failed:
            self._fail(seqs, prefill_error(exc))

    def _decode(self) -> None:
        rows = list(self._batch.rows)
        voice = [i for i, s in enumerate(rows) if s.interactive]
        if self.limits.voice_alone and voice and len(voice) < len(rows):
            self._decode_alone(voice)
            return
        masks = self._start_masks(rows)
        start = self.clock()
        try:
            logits = self.lm.decode_runs(self._batch, [s.feed for s in rows])
        except Exception as exc:
            if not isinstance(exc, EdgeAgentError):
                log.exception("decode step failed")
                exc = EdgeAgentError(f"decode step failed: {exc}")
            self._batch.remove(range(len(rows)))
            self._fail(rows, exc)
            return
        self.steps += 1
        now = self.clock()
        with self._cond:
            self.rates.step((now - start) * 1e3, now)
        self._absorb(0, logits, masks)

    def _decode_alone(self, indices: Sequence[int]) -> None:
        """A step for the voice turns' rows alone (``Limits.voice_alone``): on a CPU a batch of nine costs
        several times a batch of one, and a person is waiting on these; the chats' rows keep their pending
        tokens for the next full step, their output unchanged."""
        rows = self._batch.rows
        seqs = [rows[i] for i in indices]
        masks = self._start_masks(seqs)
        try:
            logits = np.concatenate([self.lm.extend(self._batch, i, rows[i].feed) for i in indices])
        except Exception as exc:
            if not isinstance(exc, EdgeAgentError):
                log.exception("voice step failed")
                exc = EdgeAgentError(f"decode step failed: {exc}")
            self._batch.remove(list(indices))
            self._fail(seqs, exc)
            return
        self.steps += 1
        self._absorb_rows(list(indices), logits, masks)

    def _start_masks(self, seqs: Sequence[_Sequence]) -> list[Future | None]:
        """Start computing each constrained row's mask of allowed tokens (None for free rows)."""
        if not any(s.constraint is not None for s in seqs):
            return [None] * len(seqs)
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix=f"llm-mask-{self.lm.ref.name}")
        return [self._masker.submit(s.constraint.allowed) if s.constraint is not None else None for s in seqs]

    def _absorb(self, first: int, logits, masks: Sequence[Future | None] = ()) -> None:
        """Batch rows ``first…`` take their next token from ``logits`` [n, V]; finished rows leave."""
        self._absorb_rows(list(range(first, len(self._batch.rows))), logits, masks)

    def _absorb_rows(self, indices: list[int], logits, masks: Sequence[Future | None] = ()) -> None:
        """Batch rows ``indices`` (ascending) take their next token from ``logits`` [n, V] (row k of it for
        ``indices[k]``); finished rows leave."""
        now = self.clock()
        finished: list[int] = []
        broken: dict[int, FormatError] = {}  # rows whose own output format broke: they alone fail
        if self.lm.vocab_limit is not None:
            logits = logits[:, : self.lm.vocab_limit]  # never an id the tokenizer cannot decode
        all_rows = self._batch.rows
        rows = [all_rows[i] for i in indices]
        # Plain greedy rows (no format, bias, penalty or logprobs) share one argmax over the batch.
        plain = np.argmax(logits, axis=-1) if any(s.sampler.plain for s in rows) else None
        for k, (i, seq) in enumerate(zip(indices, rows)):
            mask = masks[k] if masks else None
            if plain is not None and mask is None and seq.sampler.plain:
                token = int(plain[k])
            else:
                try:
                    allowed: np.ndarray | None = mask.result() if mask is not None else None
                except FormatError as exc:
                    broken[i] = exc
                    continue
                if allowed is not None and _closing(seq):
                    narrowed = allowed & self.lm.token_vocab.closers
                    allowed = narrowed if narrowed.any() else allowed
                row = seq.sampler.process(logits[k], seq.history, seq.generated, allowed)
                token = seq.sampler.pick(row)
            logprob = None
            if seq.params.logprobs is not None:
                lp, top = logprobs_of(row, token, seq.params.logprobs)
                vocab = self.lm.token_vocab
                alternatives = tuple((t, vocab.token_bytes(t), v) for t, v in top)
                logprob = TokenLogprob(token, vocab.token_bytes(token), lp, alternatives)
                seq.logprobs.append(logprob)
            try:  # the mask allowed it, yet llguidance may still break on it (a parser limit)
                reason = self._take(seq, token, logprob, now)
                seq.feed = [token]
                if reason is None and self._jumps(seq):
                    for forced in seq.constraint.forced():
                        seq.feed.append(forced)
                        reason = self._take(seq, forced, None, now, forced=True)
                        if reason:
                            break
            except FormatError as exc:
                broken[i] = exc
                continue
            if reason:
                finished.append(i)
        gone = sorted([*finished, *broken])
        for i, seq in zip(gone, self._batch.remove(gone)):
            if i in broken:
                self._format_broke(seq, broken[i])
            else:
                self._complete(seq, seq.finish_reason or "length")

    def _take(
        self, seq: _Sequence, token: int, logprob: TokenLogprob | None, now: float, forced: bool = False
    ) -> str | None:
        """``seq`` takes ``token`` (picked, or ``forced`` by its output format): recorded, checked, fed to its
        format and delivered. Returns why the request ends here, or None; a ``FormatError`` if its format
        breaks on the token."""
        seq.generated.append(token)
        seq.steps += not forced
        seq.history.append(token)
        seq.recorder.mark_token(at=now)  # every row's token of this step came out at the same moment
        reason = self._finish_reason(seq, token, now, forced)
        if seq.constraint is not None and reason is None:
            seq.constraint.consume(token)
            if seq.constraint.stopped:
                reason = "stop"  # the format is complete: nothing may follow
        self._deliver(seq, token, reason is not None, logprob, now)
        reason = seq.finish_reason or reason  # delivery may have found a stop string
        if reason:
            seq.finish_reason = reason
        return reason

    def _jumps(self, seq: _Sequence) -> bool:
        """Whether ``seq`` takes the tokens its format forces without a step each (jump-forward decoding):
        they need no logits, unless it asked for logprobs."""
        return self.limits.jump_forward and seq.constraint is not None and seq.params.logprobs is None

    def _format_broke(self, seq: _Sequence, exc: FormatError) -> None:
        """``seq``'s own output format broke: it fails with that error, nobody else hears of it."""
        self._limited(
            logging.WARNING,
            "format_failed",
            "%s: request %d failed after %d tokens: %s",
            self.lm.ref.name,
            seq.handle.id,
            len(seq.generated),
            exc,
        )
        self._fail([seq], exc)

    def _finish_reason(self, seq: _Sequence, token: int, now: float, forced: bool = False) -> str | None:
        p = seq.params
        if seq.handle.cancelled:
            return "cancelled"
        if not p.ignore_eos and token in self.lm.contract.eos_ids:
            return "stop"
        if len(seq.generated) >= p.max_new_tokens:
            return "length"
        if not forced and repeated_too_often(seq.generated, p.max_repeats):  # a format's own tokens may repeat
            return "repetition"
        if seq.deadline_s is not None and now >= seq.deadline_s:
            return "deadline"
        return None

    def _deliver(self, seq: _Sequence, token: int, final: bool, logprob: TokenLogprob | None, now: float) -> None:
        if seq.predicted_first_s is not None:  # its first token: how late against admission's prediction
            with self._cond:
                self.lateness.observe(seq.predicted_first_s, now)
            seq.predicted_first_s = None
        seq.decoder.push(token)
        text = seq.decoder.text
        stops = seq.params.stop
        if stops:
            cut = find_stop(text, stops, seq.emitted)
            if cut is not None:
                text, final = text[:cut], True
                seq.finish_reason = "stop"
        # Hold back what could still become a stop string or a split character.
        hold = max(len(s) for s in stops) - 1 if stops and not final else 0
        safe = max(seq.emitted, len(text) - hold)
        if text.endswith("\ufffd") and not final:
            safe = min(safe, len(text) - 1)
        piece = text[seq.emitted : safe]
        seq.emitted = max(seq.emitted, safe)
        seq.handle.push(TokenEvent(token, piece, now, logprob))
        if final and stops:
            seq.final_text = text

    def _complete(self, seq: _Sequence, reason: str) -> None:
        timing = seq.recorder.finish()
        # a voice reply started ahead is tagged a warm-up (kept out of the SLA windows), but its steps are a
        # voice reply's: learnt too (a prefill ahead, capped at one token, never lowers the mean)
        if reason != "cancelled" and (seq.interactive or not seq.warmup):
            with self._cond:
                self.rates.finished(seq.steps, timing.finished_s, capped=reason == "length", voice=seq.interactive)
        voiced = reason != "cancelled" and not seq.warmup and seq.interactive
        if voiced and self.urgency is not None and timing.scheduled_s is not None:
            self.urgency.reply_done(timing.finished_s - timing.scheduled_s)
        if self._wait is not None and timing.ttft_ms is not None:
            with self._cond:
                self._wait.on_latency(timing.ttft_ms, self.sla_ms())
        text = seq.final_text if seq.final_text is not None else seq.decoder.text
        self._report(timing)  # recorded before the caller can see the result: its metrics are in when it looks
        seq.handle.finish(Completion(text, tuple(seq.generated), reason, timing, tuple(seq.logprobs)))

    def _fail(self, seqs: list[_Sequence], exc: BaseException) -> None:
        for seq in seqs:
            timing = seq.recorder.finish()
            self._report(timing, error=True)
            seq.handle.finish(None, exc)

    def _report(self, timing: RequestTiming, error: bool = False) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(timing)
            except Exception:  # metrics must never stop serving
                log.exception("on_finished callback failed")


def _to_prefill(seq: _Sequence) -> int:
    """Prompt tokens a waiting sequence has still to prefill (a preempted one: only what its KV lacks)."""
    return len(seq.history) - seq.resume[0] if seq.resume else len(seq.prompt)


def _prefix_cache(lm: DecoderLM, limits: Limits) -> PrefixCache | None:
    """The scheduler's prefix KV cache, or None: off in ``limits``, or a model that takes no outside KV."""
    if limits.prefix_cache_mb <= 0:
        return None
    if lm.max_rows is not None:
        log.info(
            "%s: no prefix cache: a stateful model (the NPU's LLM mode) keeps its KV inside the runtime, "
            "where no cached prefix can be put",
            lm.ref.name,
        )
        return None
    block = kv_bytes_per_token(lm.contract) * limits.prefix_block_tokens
    if limits.prefix_cache_mb * 2**20 < block:  # it could never store a block: refused, never silently empty
        raise ConfigError(
            [
                (
                    "prefix_cache.max_mb",
                    f"{limits.prefix_cache_mb:g} MiB is below one block of {lm.ref.name} ({limits.prefix_block_tokens} "
                    f"tokens: {block / 2**20:.3g} MiB), so its prefix cache could hold nothing; set max_mb to at "
                    f"least {block / 2**20:.3g}, or prefix_cache.enabled = false",
                )
            ]
        )
    log.info(
        "%s: prefix cache of %g MB, prompts matched in blocks of %d tokens",
        lm.ref.name,
        limits.prefix_cache_mb,
        limits.prefix_block_tokens,
    )
    return PrefixCache(int(limits.prefix_cache_mb * 2**20), limits.prefix_block_tokens)
