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
bounded (``Overloaded`` at submit), waiting is bounded (``DeadlineExceeded``), and a handle can be
cancelled at any time. Handles are thread-safe: any thread may submit, read and cancel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ...errors import ConfigError, DeadlineExceeded, EdgeAgentError, Overloaded, Unavailable
from ...logsetup import LogLimiter
from ...metrics.timing import RequestTiming, TimingRecorder
from ...models.grammar import Constraint, FormatError
from ...models.llm import DecoderLM, KvBatch
from ...models.llm_contract import kv_bytes_per_token
from ...models.prefix_cache import PrefixCache, PrefixStats
from ...models.sampling import Sampler, SamplingParams, find_stop, logprobs_of, repeated_too_often
from ...models.tokenizer import StreamDecoder
from ..batch_wait import AdaptiveWait
from .admission import INTERACTIVE, Limits, plan_admission
from .handle import Completion, RequestHandle, TokenEvent, TokenLogprob
from .prefill import Prefills, prefill_deadline, prefill_error

log = logging.getLogger(__name__)


DEFAULT_PARAMS = SamplingParams()  # frozen: one shared default
DEFAULT_LIMITS = Limits()
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
    ) -> None:
        self.handle, self.prompt, self.params = handle, prompt, params
        self.constraint = constraint
        self.logprobs: list[TokenLogprob] = []
        self.admitted_s = admitted_s
        self.interactive = INTERACTIVE in tags  # queues ahead of requests that are not
        self.recorder = TimingRecorder(len(prompt), tags, clock=clock, admitted_s=admitted_s)
        self.deadline_s = deadline_s
        self.sampler = Sampler(params)
        self.decoder = decoder
        self.generated: list[int] = []
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
    ) -> None:
        if lm.max_rows is not None and limits.max_batch > lm.max_rows:  # a stateful model: one sequence
            limits = replace(limits, max_batch=lm.max_rows, preferred_batch_sizes=(lm.max_rows,))
        self.lm, self.limits, self.clock = lm, limits, clock
        self.on_finished = on_finished
        self._waiting: deque[_Sequence] = deque()
        self._batch: KvBatch = lm.new_batch(limits.max_batch)
        lm.warm_slots(self._batch)  # here, on the loading thread, not in the first requests' prefills
        self.prefix_cache = _prefix_cache(lm, limits)
        self._prefills: Prefills[_Sequence] = Prefills(
            lm, limits.prefill_chunk_tokens, limits.prefill_together, self.prefix_cache
        )  # admitted, prompt not all in
        self._cond = threading.Condition()
        self._stopping = False
        self._next_id = 0
        self._thread = threading.Thread(target=self._loop, name=f"llm-{lm.ref.name}", daemon=True)
        self._masker: ThreadPoolExecutor | None = None  # output-format masks, made while the engine runs
        timeout_s = limits.batch_timeout_ms / 1e3
        self._wait = AdaptiveWait(timeout_s) if limits.adaptive and timeout_s > 0 else None
        # a flood of bad formats costs a line per period, not per request
        self._limited = LogLimiter(clock=clock, logger=log)
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
        if self._masker is not None:
            self._masker.shutdown(wait=False)

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters (None: this model runs without one)."""
        return None if self.prefix_cache is None else self.prefix_cache.stats

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running); a sequence whose prompt is being prefilled is running"""
        return len(self._waiting), len(self._batch) + len(self._prefills)

    def backlog(self) -> list[tuple[int, int]]:
        """(prompt tokens still to prefill, tokens still to generate) of each sequence decoding, being
        prefilled or waiting: the work ahead of a request admitted now (any thread: a snapshot)."""
        # Read in the order sequences move (waiting → prefills → batch): one moving between two reads is
        # counted twice, never missed.
        with self._cond:
            waiting = list(self._waiting)
        prefilling = self._prefills.pending()
        rows = list(self._batch.rows)
        out = [(0, max(0, s.params.max_new_tokens - len(s.generated))) for s in rows]
        out += [(left, s.params.max_new_tokens) for s, left in prefilling]
        return out + [(len(s.prompt), s.params.max_new_tokens) for s in waiting]

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        deadline_ms: float | None = None,
        tags: Sequence[str] = (),
    ) -> RequestHandle:
        self.lm.check_prompt(prompt_ids, params.max_new_tokens)
        # Compiling the output format and its first mask happens here, on the caller's thread, never on
        # the device thread; a format that cannot start is refused before it could join a batch.
        try:
            constraint = self.lm.token_vocab.constraint(params.grammar) if params.grammar else None
        except FormatError as exc:
            self._limited(logging.WARNING, "format_refused", "%s: output format refused: %s", self.lm.ref.name, exc)
            raise
        now = self.clock()
        with self._cond:
            if self._stopping:
                raise Unavailable("the agent is shutting down and admits no new requests")
            if len(self._waiting) >= self.limits.max_queue:
                raise Overloaded(f"queue full ({self.limits.max_queue} waiting); retry later")
            self._next_id += 1
            if self._wait is not None:
                self._wait.observe_arrival(now)
            handle = RequestHandle(self._next_id, on_cancel=self._wake)
            deadline = now + deadline_ms / 1e3 if deadline_ms is not None else None
            seq = _Sequence(
                handle,
                list(prompt_ids),
                params,
                now,
                deadline,
                StreamDecoder(self.lm.tokenizer),
                tags,
                self.clock,
                constraint,
            )
            if seq.interactive:  # ahead of every waiter that is not interactive itself
                self._waiting.insert(sum(1 for s in self._waiting if s.interactive), seq)
            else:
                self._waiting.append(seq)
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
                if not self._take_admitted():
                    return
            try:
                if len(self._prefills):
                    self._prefill()
                if len(self._batch):
                    self._decode()
            except Exception as exc:  # a bug here must fail requests, never the device thread
                log.exception("serving loop error")
                rows = self._batch.remove(range(len(self._batch))) + self._prefills.drop(self._batch)
                self._fail([s for s in rows if not s.handle.done], EdgeAgentError(f"internal serving error: {exc}"))

    def _take_admitted(self) -> bool:
        """Under the lock: drop expired/cancelled waiters, then admit (to the prefills) or sleep. False = exit."""
        while True:
            if not self._waiting and (len(self._batch) or len(self._prefills)):
                return True  # nothing to admit: back to the running sequences at once
            now = self.clock()
            for seq in [s for s in self._waiting if s.handle.cancelled or self._expired(s, now)]:
                self._waiting.remove(seq)
                self._reject(seq, now)
            running = len(self._batch) + len(self._prefills)
            n, wake_at = plan_admission([s.admitted_s for s in self._waiting], running, now, self.limits, self._wait)
            if n or running:
                admitted = [self._waiting.popleft() for _ in range(n)]
                self._prefills.add(
                    admitted, [s.prompt for s in admitted], [len(s.prompt) + s.params.max_new_tokens for s in admitted]
                )
                return True
            if self._stopping and not self._waiting:
                return False
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            self._cond.wait(timeout if timeout is not None else 0.5)

    def _expired(self, seq: _Sequence, now: float, waiting: bool = True) -> bool:
        waited_ms = (now - seq.admitted_s) * 1e3
        queued_too_long = waiting and waited_ms > self.limits.queue_timeout_ms
        return queued_too_long or (seq.deadline_s is not None and now > seq.deadline_s)

    def _reject(self, seq: _Sequence, now: float) -> None:
        if seq.handle.cancelled:
            self._complete(seq, "cancelled")
            return
        timing = seq.recorder.finish()
        self._report(timing)
        seq.handle.finish(
            None,
            DeadlineExceeded(
                f"request {seq.handle.id} waited {(now - timing.admitted_s) * 1e3:.0f} ms in the queue and was "
                f"not started (queue timeout {self.limits.queue_timeout_ms:.0f} ms or its own deadline)"
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
            if starts:
                seq.recorder.mark_scheduled()
                seq.recorder.mark_cached(cached)
        joining = [seq for seq, _, completes, _ in plan if completes]
        masks = dict(zip(map(id, joining), self._start_masks(joining)))

        def joined(first: int, logits: np.ndarray) -> None:  # their first tokens stream before the next prefill
            self._absorb(first, logits, [masks[id(s)] for s in self._batch.rows[first:]])

        for seqs, exc in self._prefills.run(self._batch, decoding, joined):
            self._fail(seqs, prefill_error(exc))

    def _decode(self) -> None:
        rows = list(self._batch.rows)
        masks = self._start_masks(rows)
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
        self._absorb(0, logits, masks)

    def _start_masks(self, seqs: Sequence[_Sequence]) -> list[Future | None]:
        """Start computing each constrained row's mask of allowed tokens (None for free rows)."""
        if not any(s.constraint is not None for s in seqs):
            return [None] * len(seqs)
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix=f"llm-mask-{self.lm.ref.name}")
        return [self._masker.submit(s.constraint.allowed) if s.constraint is not None else None for s in seqs]

    def _absorb(self, first: int, logits, masks: Sequence[Future | None] = ()) -> None:
        """Batch rows ``first…`` take their next token from ``logits`` [n, V]; finished rows leave."""
        now = self.clock()
        finished: list[int] = []
        broken: dict[int, FormatError] = {}  # rows whose own output format broke: they alone fail
        if self.lm.vocab_limit is not None:
            logits = logits[:, : self.lm.vocab_limit]  # never an id the tokenizer cannot decode
        rows = self._batch.rows[first:]
        # Plain greedy rows (no format, bias, penalty or logprobs) share one argmax over the batch.
        plain = np.argmax(logits, axis=-1) if any(s.sampler.plain for s in rows) else None
        for i, seq in enumerate(rows, start=first):
            mask = masks[i - first] if masks else None
            if plain is not None and mask is None and seq.sampler.plain:
                token = int(plain[i - first])
            else:
                try:
                    allowed: np.ndarray | None = mask.result() if mask is not None else None
                except FormatError as exc:
                    broken[i] = exc
                    continue
                if allowed is not None and _closing(seq):
                    narrowed = allowed & self.lm.token_vocab.closers
                    allowed = narrowed if narrowed.any() else allowed
                row = seq.sampler.process(logits[i - first], seq.history, seq.generated, allowed)
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
        if self._wait is not None and timing.ttft_ms is not None:
            with self._cond:
                self._wait.on_latency(timing.ttft_ms, self.limits.sla_ms)
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
