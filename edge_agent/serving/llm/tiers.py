"""One LLM workload served from a ladder of model tiers, switched without failing a request.

**Admission.** Each request is judged when it arrives (``serving.tiers.admission``): its first-token time
predicted on the serving tier from what runs and waits there, plus a margin for how late admitted chats'
first tokens have been coming against their predictions lately (``Lateness``), against its class budget: a chat's is the
SLA in force (``sla_ms``, read at each request) or the client's shorter ``deadline_ms``; a voice turn's
(``interactive``) is never refused while chats are admitted (it preempts one instead). A chat that does
not fit, where a lighter tier sharing the loaded model would fit it, is admitted with that tier's reply
cap and the ladder reports pressure (``on_pressure``: the controller switches without waiting for
samples); one that fits nowhere is refused at once (``Overloaded``: HTTP 429 with ``Retry-After``).
An admitted chat must start within its budget or is refused then, before any of its reply went out.
Every arrival's verdict is counted (``pressure``) for the controller.

**Switches.** Tiers with the same ``weights`` (the same model, backend, device and precision: tiers
that differ only in settings) share one loaded model and one scheduler: a switch between them loads
nothing and changes the limits at the next step. A switch to other weights loads and warms the next
tier on a background thread while the current one keeps serving; then every request still waiting
moves to the new tier at once (prepared again for its model), and the old tier's scheduler finishes
only the rows it runs before its model is closed, its steps taking turns with the new tier's (``step_gate``:
one step at a time on the cores, so the moved requests start at the new tier's speed, not at half of it while
the old tier drains beside it). One switch runs at a time, so at most two models
are ever in memory. Prompts are tokenized by the tier that serves them: tiers may use different
tokenizers.

Relief from the controller applies to new requests: ``token_cap_ratio`` truncates their
``max_new_tokens`` (not a constrained request's: a tool call or JSON cut short is no answer),
``shedding`` rejects them with ``Unavailable`` (HTTP 503, with a retry hint) only with admission off
(``predictive`` False: with it on, admission refuses precisely what would be late and never a voice turn),
``max_batch`` resizes the active scheduler's batch within what its KV buffers hold.

A tier builds its output formats' token table as it loads (on the loading thread), not at its first
constrained request: for Gemma 3's 262k tokens that takes seconds, which a voice turn, and every arrival
held behind a switch that moved a constrained request, would otherwise wait.

**Loaded ahead.** The tier below the serving one, when its weights differ (another engine: the recipe's
lower rung), is loaded and warmed on a thread of its own once the serving tier is up (``load_ahead``), and
waits idle beside it: a switch down takes it over and loads nothing; a switch back up loads the upper
tier and keeps the lower one as the tier ahead (it finishes its running rows meanwhile). The cost is the
lower tier's memory, held while the upper one serves.

**Spill.** A tier that holds one sequence at a time (the NPU's LLM mode) is served with the next tier
beside it, loaded with it: a request goes there instead when the active tier cannot take it (its prompt
does not fit the NPU's context, or is too short for its prefill) or when the work already on it would
make its first token later than the spill threshold (``spill.decide``: an idle tier takes every request
it can hold; a busy one by its predicted first token, from the tier's measured rates). The threshold is
read at each decision (``spill_threshold``, set by the agent to follow the SLA in force), and the decision and the
hand-over to the scheduler are one step under one lock, so requests arriving together never all see an
idle tier. The handle says so (``spill``: the tier it left and why); the request is observed under the
tier that served it, marked as spilled from the active tier, so the active tier's controller still sees
what its requests got, and the controller switches on the SLA as before; a switch to the spill tier takes
the loaded copy over instead of loading it again. A warm-up (``warmup`` tag: a voice turn's prefill
ahead) is routed as the request it warms (``route_new_tokens``), so it fills the cache of the tier that
will serve that request.

A prompt is measured before it is tokenized: longer than the tier's context (``max_context``
tokens) times ``MAX_CHARS_PER_TOKEN`` characters, or with more messages than the context has
tokens, it cannot fit and is refused at once (``ContextLengthExceeded``) — tokenizing tens of
megabytes of text takes minutes and gigabytes for an answer known in advance. 32 characters per
token is generous: text averages 3–5 characters per token in the tokenizers served here, and only
long runs of one repeated character come near 16; every message renders to at least one token.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...errors import InputError, Overloaded, Unavailable
from ...metrics.window import FIRST_AFTER_LOAD, WARMUP
from ...models.llm import DecoderLM
from ...models.prefix_cache import PrefixStats
from ...models.sampling import SamplingParams
from ...models.tokenizer import Message
from ...observe import Observation, Observer
from ..tiers.admission import judge
from ..tiers.ladder import Ladder
from .scheduler import DEFAULT_PARAMS, Limits, LLMScheduler, RequestHandle
from .spill import Verdict, decide
from .step_gate import StepGate

if TYPE_CHECKING:
    from ...config import BatchingConfig, LLMTierConfig, ModelsConfig, PrefixCacheConfig

MAX_CHARS_PER_TOKEN = 32
SPILLED_FROM = "spilled_from:"  # a request tag: served by the spill tier of the tier named after it
log = logging.getLogger(__name__)


class ContextLengthExceeded(InputError):
    """The prompt (with ``max_new_tokens``) does not fit the serving tier's context."""

    code = "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class Tier:
    """One rung of the LLM ladder: how to open it, its batching limits, its token cap."""

    name: str
    open: Callable[[], DecoderLM]  # loads and warms the model (DecoderLM.open does both)
    limits: Limits = field(default_factory=Limits)
    max_new_tokens: int = 256
    model: str = ""  # the configured model, as observations name it
    engine: Callable[[], str | None] | None = None  # what the tier loaded (engine:<key>, model:<sha>), once open
    weights: str | None = None  # tiers with the same key share one loaded model (None: its own)


def tier_limits(
    tier: LLMTierConfig, batching: BatchingConfig, prefix_cache: PrefixCacheConfig, sla_ms: float
) -> Limits:
    """The batching and admission limits of ``tier``'s scheduler, from its own settings and the ``[batching]``
    and ``[prefix_cache]`` sections: the one place each limit gets its value (the tier's batch, else
    ``[batching]``'s; a stateful model's one row and the KV buffers' rows bound it where it loads)."""
    max_batch = tier.rows(batching)
    return Limits(
        max_batch=max_batch,
        batch_timeout_ms=batching.batch_timeout_ms,
        preferred_batch_sizes=tuple(x for x in batching.preferred_batch_sizes if x <= max_batch),
        max_queue=batching.max_queue,
        queue_timeout_ms=batching.queue_timeout_ms,
        adaptive=batching.adaptive_wait,
        sla_ms=sla_ms,
        prefill_chunk_tokens=batching.prefill_chunk_tokens,
        prefill_together=(
            batching.prefill_together if batching.prefill_together is not None else tier.backend == "tensorrt"
        ),
        prefix_cache_mb=prefix_cache.limit_mb,
        prefix_block_tokens=prefix_cache.block_tokens,
        jump_forward=batching.jump_forward,
        voice_alone=tier.backend != "tensorrt",  # a GPU runs a batch for little more than one row
    )


@dataclass(slots=True)
class Pressure:
    """Arrivals since the controller last looked: how many, how many predicted over their budget (admitted
    on a lighter tier's settings, or refused) and how many refused."""

    arrivals: int = 0
    over_budget: int = 0
    refused: int = 0


class _Loaded:
    engine: str | None
    scheduler: LLMScheduler
    label: list[str]

    def __init__(
        self,
        index: int,
        tier: Tier,
        lm: DecoderLM,
        observe: Observer,
        clock: Callable[[], float],
        rows: int | None = None,
        share: _Loaded | None = None,
        gate: StepGate | None = None,
    ) -> None:
        """``share``: a loaded tier with the same weights, whose model and scheduler this one serves with;
        ``gate``: the step gate of the schedulers on the same cores (``step_gate``)."""
        self.index, self.tier, self.lm = index, tier, lm
        self.spill: _Loaded | None = None  # the next tier, beside a one-sequence tier (see the module doc)
        self.ahead: _Loaded | None = None  # the next tier, loaded ahead when its weights differ (module doc)
        self.adopted = False  # swapped out, but kept as the new active tier's spill tier or tier ahead
        if share is not None:
            self.engine = share.engine
            self.scheduler, self.label = share.scheduler, share.label
            self.first = False  # nothing was loaded
            return
        # The tier is known here, where the scheduler is made: each observation says so, typed, with
        # the engine it opened (asked once, now that it is open: a later build does not rename this one).
        engine = self.engine = tier.engine() if tier.engine is not None else None
        self.label = [tier.name, tier.model]  # the tier its requests are observed under (settings-only switches)
        label = self.label

        def finished(timing) -> None:
            obs = Observation.of_request(timing, label[0], label[1], engine)
            spilled = [t[len(SPILLED_FROM) :] for t in timing.tags if t.startswith(SPILLED_FROM)]
            observe(replace(obs, spilled_from=spilled[0]) if spilled else obs)

        self.scheduler = LLMScheduler(lm, tier.limits, clock=clock, on_finished=finished, rows=rows, gate=gate).start()
        self.first = True  # the next request is the first after a load: excluded from SLA windows

    def verdict(self, prompt_tokens: int, threshold_ms: float | None, now: float) -> Verdict:
        """Whether this one-sequence tier takes a prompt of ``prompt_tokens`` now (``spill.decide`` on the
        scheduler's own prediction)."""
        busy = sum(self.scheduler.load)  # waiting + running (prefilling included)
        return decide(busy, self.scheduler.predict_ttft_ms(prompt_tokens, now=now), threshold_ms)

    def limits(self) -> Limits:
        """This tier's limits within what its scheduler's batch holds."""
        rows = min(self.tier.limits.max_batch, self.scheduler.capacity)
        sizes = tuple(s for s in self.tier.limits.preferred_batch_sizes if s <= rows) or (rows,)
        return replace(self.tier.limits, max_batch=rows, preferred_batch_sizes=sizes)

    def close(self, drain_s: float) -> None:
        self.scheduler.stop(drain_s)
        self.lm.close()
        if self.spill is not None:
            self.spill.close(drain_s)
            self.spill = None
        if self.ahead is not None:
            self.ahead.close(drain_s)
            self.ahead = None


class TieredLLM(Ladder):
    """The LLM workload: a ladder of ``Tier``s, one ``LLMScheduler`` serving the active one (see the
    module doc). Each finished request reaches ``observe`` as an ``observe.Observation``."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        observe: Observer | None = None,
        on_switched: Callable[[int, int, float, str | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        drain_s: float = 120.0,
        spill_slack_ms: float | None = None,
    ) -> None:
        """``on_switched(old, new, load_ms, error)`` is told when a switch completes or fails;
        ``spill_slack_ms``: the expected first-token time above which a busy one-sequence tier's request
        goes to its spill tier (None: only requests it cannot take); ``spill_threshold``, when set, is
        asked instead at each decision."""
        super().__init__(tiers, on_switched)
        self._observe = observe or (lambda obs: None)
        self._clock = clock
        self._drain_s = drain_s
        self.spill_slack_ms = spill_slack_ms
        self.spill_threshold: Callable[[], float | None] | None = None  # e.g. the SLA in force's (daemon.app)
        self._spill_lock = threading.Lock()  # one spill decision and its hand-over at a time
        self.token_cap_ratio = 1.0
        self.shedding = False
        # [calibration] capture: told each admitted request's prompt or messages; it never blocks
        self.capture: Callable[[str | Sequence[Message]], None] | None = None
        # Admission (see the module doc): the chat budget in force (None: no predicted refusals), told of
        # pressure, and the counts the controller reads; set by the agent.
        self.sla_ms: Callable[[], float] | None = None
        self.predictive = True  # refuse chats predicted over budget (False: they queue)
        self.on_pressure: Callable[[], None] | None = None
        self.on_preempted: Callable[[], None] | None = None
        self._pressure = Pressure()
        self._voice_streams = 0
        self.load_ahead = True  # the next tier with other weights is loaded ahead (see the module doc)
        self._ahead: tuple[int, threading.Thread] | None = None  # (tier index, the thread loading it)
        self._stopped = False
        self._gate = StepGate()  # the batched tiers' steps, one at a time (a drain beside the serving tier)

    @classmethod
    def from_config(
        cls,
        models: ModelsConfig,
        batching: BatchingConfig,
        prefix_cache: PrefixCacheConfig,
        sla_ms: float,
        open_model: Callable[[LLMTierConfig], DecoderLM],
        weights: Callable[[LLMTierConfig], str | None] = lambda tier: None,
        engine: Callable[[str], str | None] | None = None,
        **kwargs: Any,
    ) -> TieredLLM:
        """The ladder of ``[[models.llm]]`` (not started): each tier's limits (``tier_limits``), its reply cap,
        ``open_model(tier)`` to load it, ``weights(tier)`` saying which tiers share one loaded model,
        ``engine(name)`` what a loaded tier serves; admission from ``[batching] admission``, loading ahead
        from ``[models] load_ahead``. ``kwargs`` go to the constructor (observe, on_switched, drain_s)."""
        tiers = [
            Tier(
                t.name,
                functools.partial(open_model, t),
                tier_limits(t, batching, prefix_cache, sla_ms),
                t.max_new_tokens,
                t.model,
                engine=functools.partial(engine, t.name) if engine is not None else None,
                weights=weights(t),
            )
            for t in models.llm
        ]
        ladder = cls(tiers, **kwargs)
        ladder.predictive, ladder.load_ahead = batching.admission, models.load_ahead
        return ladder

    def start(self, tier: int = 0) -> TieredLLM:
        super().start(tier)
        self._serve(self._active)
        return self

    def _serve(self, loaded: _Loaded) -> None:
        """``loaded`` becomes the serving tier: its limits, the SLA it reads, the voice streams open."""
        sched = loaded.scheduler
        sched.limits = loaded.limits()
        sched.on_preempted = self.on_preempted
        if self.sla_ms is not None:
            sched.sla_ms = self.sla_ms
        sched.queue.set_voice_streams(self._voice_streams)
        self._prepare_ahead(loaded)
        loaded.label[:] = [loaded.tier.name, loaded.tier.model]

    def _prepare_ahead(self, loaded: _Loaded) -> None:
        """Load the tier below ``loaded`` on a thread of its own when its weights differ (see the module doc);
        it waits, warm and idle, until a switch takes it over or ``loaded`` retires."""
        index = loaded.index + 1
        if not self.load_ahead or index >= len(self.tiers) or loaded.spill is not None or loaded.ahead is not None:
            return
        tier = self.tiers[index]
        if tier.weights is not None and tier.weights == loaded.tier.weights:
            return  # it shares the loaded model: nothing to load

        def run() -> None:
            try:
                ahead = self._open(index)
            except Exception as exc:  # a switch to it tries again, and says why then
                log.warning("tier %r could not be loaded ahead of a switch: %s", tier.name, exc)
                return
            with self._lock:
                if self._active is loaded and not self._stopped and loaded.ahead is None:
                    loaded.ahead = ahead
                    log.info("tier %r loaded ahead beside %r: a switch loads nothing", tier.name, loaded.tier.name)
                    return
            ahead.close(5.0)  # the ladder moved on while it loaded (idle: its thread ends at once)

        thread = threading.Thread(target=run, name=f"llm-ahead-{index}", daemon=True)
        self._ahead = (index, thread)
        thread.start()

    def reload_ahead(self, tier: str) -> bool:
        """``tier``, loaded ahead, now resolves to another engine (a background build passed): load it ahead
        again. False when ``tier`` is not the one loaded ahead (it picks its engine up when next loaded)."""
        with self._lock:
            loaded = self._active
            stale = loaded.ahead if loaded is not None else None
            if loaded is None or stale is None or stale.tier.name != tier:
                return False
            loaded.ahead = None
            self._prepare_ahead(loaded)
        stale.close(self._drain_s)  # idle: nothing to drain
        return True

    def wait_ahead(self, timeout_s: float | None = None) -> None:
        """Wait for a tier being loaded ahead (tests, and a switch to that very tier)."""
        if self._ahead is not None:
            self._ahead[1].join(timeout_s)

    def _swapped(self, old: _Loaded) -> None:
        """Under the lock, right after a switch (see the module doc): the new tier's limits apply at once,
        and every request still waiting is served by it, under its reply cap."""
        new = self._active
        if old.ahead is not None and old.ahead.index == new.index + 1 and new.ahead is None:
            new.ahead, old.ahead = old.ahead, None  # a reload of the active tier keeps what was loaded ahead
        elif self.load_ahead and old.index == new.index + 1 and old.scheduler is not new.scheduler and not old.adopted:
            new.ahead, old.adopted = old, True  # a switch up: the tier left stays loaded, ahead of the next switch
        self._serve(new)
        source, target = old.scheduler.queue, new.scheduler.queue
        with source.cond:
            moving = source.take_waiting() if source is not target else list(target)
        for seq in moving:
            if seq.preempted:
                continue
            seq.handle.tier = new.tier.name
            if seq.lm is not new.lm:
                seq = self._prepare_again(new, seq)
                if seq is None:
                    continue
            elif seq.params.grammar is None:  # a format's output is never cut short
                seq.params = replace(seq.params, max_new_tokens=min(seq.params.max_new_tokens, self._cap(new)))
                seq.handle.max_new_tokens = seq.params.max_new_tokens
            if source is not target:
                with target.cond:
                    target.put(seq)
        if source is not target:
            source.set_voice_streams(0)

    def _prepare_again(self, new: _Loaded, seq):
        """A waiting request moving to a tier with other weights, prepared for its model (None: it failed)."""
        prompt, params, raw = seq.source
        try:
            ids, granted = self._admit(new, prompt, params, raw)
            fresh = new.scheduler.prepare(ids, granted, tags=seq.tags, handle=seq.handle)
        except Exception as exc:  # it cannot be served there: it fails alone, with why
            seq.handle.finish(None, exc if isinstance(exc, InputError) else InputError(str(exc)))
            return None
        fresh.admitted_s, fresh.recorder = seq.admitted_s, seq.recorder
        fresh.deadline_s, fresh.start_by_s, fresh.source = seq.deadline_s, seq.start_by_s, seq.source
        seq.handle.max_new_tokens = granted.max_new_tokens
        return fresh

    def _cap(self, loaded: _Loaded) -> int:
        return max(1, int(loaded.tier.max_new_tokens * self.token_cap_ratio))

    def voice_opened(self) -> None:
        """A voice stream opened on this ladder: chats leave a row free for it until it closes."""
        with self._lock:
            self._voice_streams += 1
            if self._active is not None:
                self._active.scheduler.queue.set_voice_streams(self._voice_streams)

    def voice_closed(self) -> None:
        with self._lock:
            self._voice_streams = max(0, self._voice_streams - 1)
            if self._active is not None:
                self._active.scheduler.queue.set_voice_streams(self._voice_streams)

    def pressure(self) -> Pressure:
        """The arrivals counted since the last call (the controller's input), and a fresh count."""
        with self._lock:
            counted, self._pressure = self._pressure, Pressure()
        return counted

    def _load(self, index: int) -> _Loaded:
        current = self._active
        tier = self.tiers[index]
        if current is not None and index != current.index and tier.weights == current.tier.weights is not None:
            # the same weights with other settings: nothing to load (see the module doc); a reload of the
            # active tier (a newly built engine) loads again
            return _Loaded(index, tier, current.lm, self._observe, self._clock, share=current)
        if current is not None and current.spill is not None and current.spill.index == index:
            # a switch down to the tier already loaded beside a one-sequence tier: take it over
            loaded, current.spill = current.spill, None
            return loaded
        if self._ahead is not None and self._ahead[0] == index:
            self.wait_ahead()  # being loaded ahead: that copy, not a second one
        if current is not None and current.ahead is not None and current.ahead.index == index:
            loaded, current.ahead = current.ahead, None  # loaded ahead: take it over
            return loaded
        loaded = self._open(index)
        if loaded.lm.max_rows == 1 and index + 1 < len(self.tiers):
            if current is not None and current.index == index + 1:
                # a switch up from the tier that becomes the spill tier: it stays loaded, not retired
                loaded.spill, current.adopted = current, True
                return loaded
            try:
                loaded.spill = self._open(index + 1)
            except Exception as exc:  # serving goes on without the spill tier, never without the active one
                name = self.tiers[index + 1].name
                log.error("tier %r could not load as the spill tier of %r: %s", name, loaded.tier.name, exc)
        return loaded

    def _open(self, index: int) -> _Loaded:
        tier = self.tiers[index]
        # its batch holds the largest batch of the tiers sharing its weights: a switch among them loads nothing
        sharing = [t.limits.max_batch for t in self.tiers if tier.weights is not None and t.weights == tier.weights]
        lm = tier.open()
        _warm_token_vocab(lm)
        # batched tiers run on the same cores; a one-sequence tier (an accelerator's) steps beside them
        gate = self._gate if lm.max_rows is None else None
        return _Loaded(index, tier, lm, self._observe, self._clock, rows=max(sharing, default=None), gate=gate)

    def _retire(self, old: _Loaded) -> None:
        if old.adopted:  # it serves on as the new tier's spill tier, or waits as its tier loaded ahead
            old.adopted = False
            return
        if self._active is not None and self._active.scheduler is old.scheduler:
            return  # the new tier serves with the same model
        old.close(self._drain_s)  # finishes every request it admitted, then frees the model

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) of the active tier."""
        loaded = self._active
        return loaded.scheduler.load if loaded is not None else (0, 0)

    def prefix_stats(self, tier: str) -> PrefixStats | None:
        """The prefix cache counters of ``tier`` while it is loaded (active or as the spill tier), else None."""
        loaded = self._active
        for candidate in (loaded, loaded.spill if loaded is not None else None):
            if candidate is not None and candidate.tier.name == tier:
                return candidate.scheduler.prefix_stats
        return None

    @property
    def spill_tier(self) -> str | None:
        """The tier loaded beside the active one to take what it cannot (see the module doc), if any."""
        loaded = self._active
        return loaded.spill.tier.name if loaded is not None and loaded.spill is not None else None

    @property
    def steps(self) -> int:
        """Decode steps of the serving tier's scheduler (progress, for the watchdog)."""
        loaded = self._active
        return loaded.scheduler.steps if loaded is not None else 0

    @property
    def model_name(self) -> str:
        loaded = self._active
        return loaded.lm.ref.name if loaded is not None else ""

    def current_spill_threshold_ms(self) -> float | None:
        """The expected first-token time above which a busy one-sequence tier's request spills, now."""
        return self.spill_threshold() if self.spill_threshold is not None else self.spill_slack_ms

    def submit(
        self,
        prompt: str | Sequence[Message],
        params: SamplingParams = DEFAULT_PARAMS,
        deadline_ms: float | None = None,
        raw: bool = False,
        tags: Sequence[str] = (),
        route_new_tokens: int | None = None,
        budget_ms: float | None = None,
    ) -> RequestHandle:
        """``route_new_tokens``: for a warm-up, the ``max_new_tokens`` of the request it warms; the tier is
        chosen as for that request (see the module doc). ``budget_ms``: the client's own first-token budget,
        when shorter than the SLA's. ``Overloaded`` when admission refuses it."""
        with self._lock:
            loaded = self._active
            assert loaded is not None, "start() first"
            if self.shedding:
                raise Unavailable(
                    f"shedding load: tier {loaded.tier.name!r} is over its latency target and no "
                    "lighter tier is left; retry in a few seconds",
                    reason="shedding",
                )
        spill = loaded.spill
        room = route_new_tokens if WARMUP in tags else None
        try:
            if spill is None:
                ids, granted = self._admit(loaded, prompt, params, raw)
                source = (prompt, params, raw)
                return self._hand_over(loaded, ids, granted, deadline_ms, tags, prompt, source, budget_ms)
            why: str | None
            try:
                ids, granted = self._admit(loaded, prompt, params, raw, room)
            except InputError as exc:
                why = f"tier {loaded.tier.name!r} cannot take it: {exc}"
            else:
                with self._spill_lock:  # the decision and the hand-over are one step (see the module doc)
                    verdict = loaded.verdict(len(ids), self.current_spill_threshold_ms(), self._clock())
                    if verdict.take:
                        return self._hand_over(loaded, ids, granted, deadline_ms, tags, prompt)
                why = verdict.reason
            ids, granted = self._admit(spill, prompt, params, raw)
            handle = self._hand_over(spill, ids, granted, deadline_ms, [*tags, SPILLED_FROM + loaded.tier.name], prompt)
        except Unavailable:
            if self._active is loaded:  # the ladder itself is stopping
                raise
            # a switch retired this tier while the prompt was being tokenized: the new tier takes it
            return self.submit(prompt, params, deadline_ms, raw, tags, route_new_tokens, budget_ms)
        handle.spill = {"from": loaded.tier.name, "reason": why or "spilled"}
        return handle

    def _hand_over(
        self,
        served: _Loaded,
        ids: list[int],
        params: SamplingParams,
        deadline_ms: float | None,
        tags: Sequence[str],
        prompt: str | Sequence[Message],
        source: tuple | None = None,
        budget_ms: float | None = None,
    ) -> RequestHandle:
        """``served``'s scheduler takes the tokenized request, if admission lets it (see the module doc);
        the handle says who serves it. ``source``: what the ladder needs to prepare it for another model."""
        with self._lock:
            marks = [*tags, FIRST_AFTER_LOAD] if served.first else list(tags)
            served.first = False
        seq = served.scheduler.prepare(ids, params, deadline_ms, marks)  # its format compiled, outside the lock
        seq.source = source
        with self._lock:
            active = self._active
            if active is not None and served.scheduler is active.scheduler:
                served = active  # a switch among tiers sharing the model: the same scheduler, today's settings
            elif active is None or served is not active.spill:
                raise Unavailable(f"tier {served.tier.name!r} was switched away from")  # submit retries
            tier = self._admission(served, seq, budget_ms) if source is not None else served.tier
            handle = served.scheduler.enqueue(seq)
        handle.tier, handle.model, handle.engine = tier.name, served.lm.ref.name, served.engine
        handle.max_new_tokens = seq.params.max_new_tokens
        if self.capture is not None:
            try:
                self.capture(prompt)
            except Exception:  # a capture fault must never fail the request it samples
                log.exception("calibration capture failed")
        return handle

    def _admission(self, served: _Loaded, seq, budget_ms: float | None) -> Tier:
        """Under the lock: admit ``seq`` on ``served`` or on a lighter tier sharing its model (whose reply cap
        it then gets), or raise ``Overloaded`` (see the module doc). Returns the tier whose settings serve it."""
        sched = served.scheduler
        if seq.warmup:
            if sched.free_rows() <= 0:
                raise Overloaded("no free row for a warm-up", reason="warmup")
            return served.tier
        if seq.interactive or self.sla_ms is None or not self.predictive:
            return served.tier  # a voice turn preempts a chat rather than wait; no SLA: no predicted refusals
        budget = self.sla_ms() if budget_ms is None else min(budget_ms, self.sla_ms())
        # it must start early enough for its own prefill to end within the budget (and has a couple of
        # steps at least: one that cannot meet it even at once is still served on an idle tier)
        prefill, step = sched.prefill_ms(len(seq.prompt), seq.admitted_s)
        seq.start_by_s = seq.admitted_s + max(budget - prefill, 2 * step) / 1e3
        self._pressure.arrivals += 1
        predicted = sched.predict_ttft_ms(len(seq.prompt), now=seq.admitted_s)
        margin = sched.lateness_ms(budget, seq.admitted_s, arriving_ms=predicted)
        verdict = judge(predicted, budget, "chat", margin)
        if verdict.admit:
            _expect_first(seq, predicted)
            return served.tier
        if sched.load == (0, 0):
            # an idle tier: only its own prefill is over the budget (a long prompt, a slow device); refusing
            # it protects no one and would leave the rates unmeasured (refusing all that follows), so it is
            # served, and not held to a start deadline it could not meet either (the device thread may take
            # a few ms to pick it up)
            seq.start_by_s = None
            return served.tier
        self._pressure.over_budget += 1
        for lighter in self._lighter_sharing(served):
            rows = min(lighter.limits.max_batch, sched.capacity)
            predicted = sched.predict_ttft_ms(len(seq.prompt), rows=rows, now=seq.admitted_s)
            if judge(predicted, budget, margin_ms=margin).admit:
                _expect_first(seq, predicted)
                if seq.params.grammar is None:
                    cap = max(1, int(lighter.max_new_tokens * self.token_cap_ratio))
                    seq.params = replace(seq.params, max_new_tokens=min(seq.params.max_new_tokens, cap))
                self._poke()
                return lighter
        self._pressure.refused += 1
        self._poke()
        raise Overloaded(verdict.reason + "; retry later", retry_after_s=verdict.retry_after_s, reason="over_budget")

    def _lighter_sharing(self, served: _Loaded) -> list[Tier]:
        weights = served.tier.weights
        if weights is None:
            return []
        return [t for t in self.tiers[served.index + 1 :] if t.weights == weights]

    def _poke(self) -> None:
        if self.on_pressure is not None:
            self.on_pressure()

    def _admit(
        self,
        loaded: _Loaded,
        prompt: str | Sequence[Message],
        params: SamplingParams,
        raw: bool,
        room: int | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """The prompt as ``loaded`` tokenizes it and the params its cap grants; what it cannot take raises.
        ``room``: the new tokens to find room for, when more than granted (a warm-up's request's)."""
        # A reply whose format a grammar fixes (a tool call, a JSON schema) is not truncated by the relief:
        # cut short, it would not parse, and is no answer at all.
        ratio = 1.0 if params.grammar is not None else self.token_cap_ratio
        cap = max(1, int(loaded.tier.max_new_tokens * ratio))
        params = replace(params, max_new_tokens=min(params.max_new_tokens, cap))
        if room is not None and min(room, cap) > params.max_new_tokens:
            fitted, _ = self._admit(loaded, prompt, replace(params, max_new_tokens=min(room, cap)), raw)
            return fitted, params
        context = loaded.lm.contract.max_context
        _check_size(prompt, context, loaded.tier.name)
        tok = loaded.lm.tokenizer
        if isinstance(prompt, str):
            ids = tok.encode(prompt) if raw or not tok.chat_template else tok.encode_chat([Message("user", prompt)])
        else:
            ids = tok.encode_chat(list(prompt))
        if len(ids) + params.max_new_tokens > context:
            raise ContextLengthExceeded(
                f"the prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                f"{len(ids) + params.max_new_tokens} exceeds tier {loaded.tier.name!r}'s context of {context} tokens"
            )
        loaded.lm.check_prompt(ids, params.max_new_tokens)
        return list(ids), params

    def relieve(self, shedding: bool, token_cap_ratio: float | None = None) -> None:
        """The controller's relief (``Ladder.relieve``); with admission on, no shedding: admission already
        refuses each chat predicted late, with its Retry-After, and never a voice turn, and it admits again
        the moment the work ahead allows, where shedding would refuse everything for a cooldown."""
        super().relieve(shedding and not self.predictive, token_cap_ratio)

    def set_max_batch(self, max_batch: int) -> None:
        """Adaptive batching: resize the active tier's batch, never above its configured max."""
        loaded = self._active
        if loaded is not None:
            size = max(1, min(max_batch, loaded.tier.limits.max_batch, loaded.lm.max_rows or max_batch))
            sizes = tuple(s for s in loaded.tier.limits.preferred_batch_sizes if s <= size) or (size,)
            loaded.scheduler.limits = replace(loaded.scheduler.limits, max_batch=size, preferred_batch_sizes=sizes)

    def stop(self, drain_s: float | None = None) -> None:
        self.wait_switched()
        with self._lock:
            self._stopped = True
        self.wait_ahead()
        if self._active is not None:
            self._active.close(self._drain_s if drain_s is None else drain_s)
            self._active = None


def _warm_token_vocab(lm: DecoderLM) -> None:
    """Build the output formats' token table now, on the thread loading the tier: built at its first
    constrained request instead (a voice turn's tool call), it took 2.4 s for Gemma 3's 262k tokens on two
    cores, in front of that turn, and under the ladder's lock when a switch moved such a request, holding
    every arrival meanwhile. A model whose table cannot be built serves unconstrained requests as before
    (a constrained one then fails alone, saying why)."""
    try:
        lm.token_vocab  # noqa: B018 - the property builds and keeps it
    except Exception as exc:
        log.warning("%s: output formats' token table not built at load: %s", lm.ref.name, exc)


def _expect_first(seq, predicted_ms: float | None) -> None:
    """Note when an admitted chat's first token is predicted, so the scheduler learns how late first tokens
    come (``Lateness``)."""
    if predicted_ms is not None:
        seq.predicted_first_s = seq.admitted_s + predicted_ms / 1e3


def _check_size(prompt: str | Sequence[Message], context: int, tier: str) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit ``context`` tokens (see the module doc)."""
    limit = context * MAX_CHARS_PER_TOKEN
    if isinstance(prompt, str):
        chars, what = len(prompt), "the prompt"
    else:
        if len(prompt) > context:
            raise ContextLengthExceeded(
                f"{len(prompt):,} messages cannot fit tier {tier!r}'s context of {context:,} "
                f"tokens: send at most {context:,}"
            )
        chars, what = sum(len(m.content) for m in prompt), "the messages"
    if chars > limit:
        raise ContextLengthExceeded(
            f"{what} hold {chars:,} characters; tier {tier!r} takes at most {limit:,} characters (its context "
            f"of {context:,} tokens × {MAX_CHARS_PER_TOKEN} characters per token): shorten the prompt"
        )
