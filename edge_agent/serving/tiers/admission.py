"""Admission on predicted first-token time: whether a request that arrives now can have its first token
within its class budget, and, when it cannot, how long until one could. Pure: the caller passes what
runs and waits, the serving rates and the budget; nothing here reads a clock, a queue or a model.

The prediction (``predict_ttft_ms``) is batch-aware. A tier has ``rows`` places in its batch. Each
running sequence holds one until its expected last token; each request ahead of this one in the queue
takes the first place that frees, holds it for its own prefill and expected tokens, and hands it on.
This request starts when a place frees after all of those have started: with fewer requests ahead than
free places that is at once (behind the prefills ahead of it), otherwise when the soonest-ending holder
ends, which under a long queue comes to the work ahead divided by the batch size. Its first token then
comes from its own prefill.

Rates (``Rates``) are learnt from what the device thread measures: milliseconds per decode step and per
prompt token prefilled, and the steps requests really take (most stop well before their cap): the tokens
they pick, one a step; the tokens their output format forces come with a pick, in the same step
(jump-forward decoding: a voice turn's 25-token tool call takes 5-7 steps). Voice turns' replies (the
interactive class) and the rest are learnt apart: a tool call is a few steps, a chat reply dozens. A
prefill costs about one step plus its tokens: the per-token rate is learnt only from prefills of at least
``PREFILL_MIN_TOKENS`` (a short one, a prefix-cache hit or a resumed row, is mostly the call itself). A
request stopped by its cap only says it wanted at least that many: it never lowers the mean. A load
seeds the step and prefill rates with one timed prefill and step (``seed``), replaced by the first real
samples. Each
is an exponentially weighted mean that ages out: a value not refreshed for ``STALE_S`` is replaced by the
next sample, not averaged with it (the device may have changed: thermal state, other load). Until a rate
is known the prediction is None and the request is admitted: nothing says it would be late.

What the model leaves out (another workload on the same cores, a recogniser pass or a voice turn that
starts after the prediction, the batch wait for batch-mates) shows as admitted requests' first tokens
coming later than predicted.
``Lateness`` keeps the last ``LATENESS_SAMPLES`` of those errors and the predictions of the last
``ARRIVAL_SAMPLES`` arrivals (admitted or not), and gives a margin that admission adds to each prediction:
the smallest with which, pairing each recent arrival's prediction with each recent error, the arrivals it
would admit get their first token within the budget ``LATENESS_QUANTILE`` of the time, not counting the
late share that even the soonest arrival would have (errors that do not come from waiting: an unmodelled
pass on the same cores can make a first token late behind an idle row, and refusing more would not make
it sooner). A box whose chats' first tokens come 150 ms late in one of twenty admits less, up front,
instead of serving them late or refusing them after they waited (a refusal is only quick at arrival: the
refused share may grow, the late refusals must not); but only as much less as the budget needs: most
arrivals are predicted well inside it, and covering every error in full (the errors' own 95th
percentile) refuses requests that would have been on time. The admitted errors feed back: a margin that
admits too much shows as later first tokens, and the margin grows. A chat refused for missing its start
deadline has no first token; it counts at its least lateness (a start that late, then its prefill), so
the chats admission let wait too long teach it as the ones served late do.

``judge`` turns a prediction into a verdict: admit when it fits the budget, else refuse with the
predicted time until a request of this size would fit (``Retry-After``) and the reason in words.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STALE_S = 60.0  # a rate not refreshed for this long no longer describes the device
PREFILL_MIN_TOKENS = 32  # shorter prefills say little about the cost per token
EWMA = 0.2  # weight of the newest sample in a fresh rate
LATENESS_SAMPLES = 32  # admitted requests whose first token the margin describes
ARRIVAL_SAMPLES = 64  # arrivals whose predictions the margin is chosen over
LATENESS_QUANTILE = 0.95  # admitted first tokens within the budget this share of the time
LATENESS_MIN_SAMPLES = 8  # fewer errors say nothing: no margin (fewer arrivals: the errors' quantile)


@dataclass(frozen=True, slots=True)
class Work:
    """One sequence's work: prompt tokens still to prefill and tokens still to generate (expected)."""

    prompt_tokens: int
    new_tokens: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """What admission says of one request: ``admit``; else ``retry_after_s`` (when one would fit) and why."""

    admit: bool
    predicted_ms: float | None
    budget_ms: float
    retry_after_s: float = 0.0
    reason: str = ""


class _Ewma:
    __slots__ = ("at_s", "provisional", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        self.at_s = -math.inf
        self.provisional = False  # a seed: the first real sample replaces it

    def learn(self, sample: float, now: float) -> None:
        if self.value is None or self.provisional or now - self.at_s > STALE_S:
            self.value = sample  # nothing recent to average with
        else:
            self.value += EWMA * (sample - self.value)
        self.at_s, self.provisional = now, False

    def seed(self, sample: float, now: float) -> None:
        self.value, self.at_s, self.provisional = sample, now, True

    def current(self, now: float) -> float | None:
        return self.value if now - self.at_s <= STALE_S else None


class Rates:
    """A tier's recent serving rates (see the module doc). Not thread-safe by itself: the scheduler's device
    thread writes it and readers take its ``snapshot`` under the scheduler's lock."""

    def __init__(self) -> None:
        self._step = _Ewma()  # ms per decode step (any batch size: the step's cost grows little with it)
        self._prefill = _Ewma()  # ms per prompt token prefilled
        self._steps = _Ewma()  # decode steps a finished request took (tokens it picked)
        self._voice_steps = _Ewma()  # the same, of voice turns' replies

    def seed(self, step_ms: float, prefill_tokens: int, prefill_ms: float, now: float) -> None:
        """Rates timed once at load (one prefill, one step), so the first requests after a load are not
        admitted blind; the first real sample of each replaces its seed."""
        self._step.seed(step_ms, now)
        if prefill_tokens >= PREFILL_MIN_TOKENS:
            self._prefill.seed(max(0.0, prefill_ms - step_ms) / prefill_tokens, now)

    def step(self, ms: float, now: float) -> None:
        self._step.learn(ms, now)

    def prefill(self, tokens: int, ms: float, now: float) -> None:
        if tokens >= PREFILL_MIN_TOKENS:
            step = self._step.current(now) or 0.0
            self._prefill.learn(max(0.0, ms - step) / tokens, now)

    def finished(self, steps: int, now: float, capped: bool = False, voice: bool = False) -> None:
        """A request finished after ``steps`` decode steps (tokens it picked); ``capped``: it stopped at its
        cap, so it would have taken at least that many: evidence for a longer mean, never for a shorter one
        (a chat capped at 8 says nothing of one capped at 48); ``voice``: a voice turn's reply."""
        ewma = self._voice_steps if voice else self._steps
        if not capped:
            ewma.learn(float(steps), now)
            return
        mean = ewma.current(now)
        if mean is not None:
            ewma.learn(max(float(steps), mean), now)

    def snapshot(self, now: float) -> Snapshot | None:
        """The current rates, or None while the step rate is unknown or stale (no per-token prefill rate yet:
        a prefill costs one step)."""
        step = self._step.current(now)
        if step is None:
            return None
        return Snapshot(
            step, self._prefill.current(now) or 0.0, self._steps.current(now), self._voice_steps.current(now)
        )


class Lateness:
    """How much later than predicted admitted requests' first tokens came lately, and what arrivals were predicted
    (see the module doc). Not thread-safe by itself: the scheduler's device thread writes it and admission reads
    and writes it under the scheduler's lock."""

    def __init__(self) -> None:
        self._errors: deque[tuple[float, float]] = deque(maxlen=LATENESS_SAMPLES)  # (when, ms late; < 0: early)
        self._arrivals: deque[tuple[float, float]] = deque(maxlen=ARRIVAL_SAMPLES)  # (when, predicted TTFT ms)

    def observe(self, predicted_s: float, actual_s: float) -> None:
        """Something admission predicted for ``predicted_s`` (a first token) came at ``actual_s`` (same clock)."""
        self._errors.append((actual_s, (actual_s - predicted_s) * 1e3))

    def arrived(self, predicted_ms: float, now: float) -> None:
        """A request arriving at ``now`` was predicted its first token in ``predicted_ms`` (admitted or not)."""
        self._arrivals.append((now, predicted_ms))

    def margin_ms(self, now: float, budget_ms: float) -> float:
        """The margin for requests of ``budget_ms`` (see the module doc), from the errors and arrivals within
        ``STALE_S``: 0 with fewer than ``LATENESS_MIN_SAMPLES`` errors; the errors' ``LATENESS_QUANTILE`` (never
        below 0) with fewer arrivals."""
        errors = np.sort([ms for at, ms in self._errors if now - at <= STALE_S])
        if len(errors) < LATENESS_MIN_SAMPLES:
            return 0.0
        predicted = np.sort([ms for at, ms in self._arrivals if now - at <= STALE_S])
        if len(predicted) < LATENESS_MIN_SAMPLES:  # the errors' own quantile: nothing to pair them with
            return max(0.0, float(errors[min(len(errors) - 1, math.ceil(LATENESS_QUANTILE * len(errors)) - 1)]))
        # admitting the j soonest arrivals: the share of (arrival, error) pairs late, over those j arrivals
        late = (len(errors) - np.searchsorted(errors, budget_ms - predicted, side="right")) / len(errors)
        # what even the soonest arrival would suffer does not come from waiting: refusing would not cure it
        fits = np.cumsum(late) / np.arange(1, len(predicted) + 1) - late[0] <= 1.0 - LATENESS_QUANTILE
        admitted = int(np.flatnonzero(fits)[-1]) + 1
        if admitted == len(predicted):
            return 0.0
        # between the last arrival it admits and the first it refuses
        return max(0.0, budget_ms - 0.5 * float(predicted[admitted - 1] + predicted[admitted]))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Rates at one moment: ms per decode step, ms per prompt token, mean decode steps a request takes, of
    voice turns' replies apart (None: unknown)."""

    step_ms: float
    prefill_ms_per_token: float
    mean_steps: float | None = None
    mean_voice_steps: float | None = None

    def expected_new(self, cap: int, taken: int = 0, voice: bool = False) -> float:
        """Decode steps a request capped at ``cap`` tokens that has taken ``taken`` is still expected to
        take: what its class (``voice``: a voice turn's reply) has been taking lately, never past its cap
        and never under one more step; a voice reply with nothing learnt yet counts as a chat does."""
        left = max(1, cap - taken)
        mean = self.mean_voice_steps if voice and self.mean_voice_steps is not None else self.mean_steps
        if mean is None:
            return float(left)
        # one that already went past the mean is expected to go on for a quarter of it at least
        expected = max(mean - taken, 0.25 * mean, 1.0)
        return float(min(left, expected))


def predict_ttft_ms(
    running_left: Sequence[float], ahead: Sequence[Work], prompt_tokens: int, rows: int, rates: Snapshot
) -> float:
    """The first-token time of a request of ``prompt_tokens`` arriving now (see the module doc).

    ``running_left``: the tokens each running sequence is still expected to generate (prompts still being
    prefilled count as ``ahead``); ``ahead``: the requests that start before this one, in order; ``rows``:
    the batch places this request's class may use."""
    start = predict_starts(running_left, [*ahead, Work(prompt_tokens, 0.0)], rows, rates)[-1]
    return start + prefill_ms(prompt_tokens, rates)  # the prefill's last logits give the first token


def predict_starts(running_left: Sequence[float], queue: Sequence[Work], rows: int, rates: Snapshot) -> list[float]:
    """When each request of ``queue`` (in order) starts its prefill, in ms from now: each takes the first
    place that frees and holds it for its prefill and expected tokens, and none starts before the prefills
    queued ahead of it have run (they share the device). ``predict_ttft_ms`` is the last one's plus its
    prefill; the scheduler checks the waiting ones against their start deadlines with it."""
    step = rates.step_ms
    frees = sorted(left * step for left in running_left)
    rows = max(1, rows)
    if len(frees) > rows:  # more running than this class may use: only the soonest-ending ones count
        frees = frees[:rows]
    heap = frees + [0.0] * (rows - len(frees))
    heapq.heapify(heap)
    prefills = 0.0  # prompt work ahead, which runs on the same device before this prompt's
    starts = []
    for work in queue:
        free = heapq.heappop(heap)
        starts.append(max(free, prefills))
        heapq.heappush(heap, free + prefill_ms(work.prompt_tokens, rates) + work.new_tokens * step)
        prefills += prefill_ms(work.prompt_tokens, rates)
    return starts


def prefill_ms(tokens: int, rates: Snapshot) -> float:
    """A prefill of ``tokens``: one step plus the per-token rate (none for nothing to prefill)."""
    return rates.step_ms + tokens * rates.prefill_ms_per_token if tokens > 0 else 0.0


def judge(predicted_ms: float | None, budget_ms: float, what: str = "request", margin_ms: float = 0.0) -> Verdict:
    """Admit when the prediction plus ``margin_ms`` (``Lateness``) fits ``budget_ms`` (or nothing could be
    predicted); else refuse, with the time until one would fit: the excess, at least a second
    (``Retry-After`` counts seconds)."""
    if predicted_ms is None or predicted_ms + margin_ms <= budget_ms:
        return Verdict(True, predicted_ms, budget_ms)
    expected_ms = predicted_ms + margin_ms
    excess_s = (expected_ms - budget_ms) / 1e3
    late = f" (with {margin_ms:.0f} ms of recent lateness)" if margin_ms > 0 else ""
    return Verdict(
        False,
        predicted_ms,
        budget_ms,
        retry_after_s=max(1.0, math.ceil(excess_s)),
        reason=f"overloaded: a {what} arriving now would get its first token in about {expected_ms:.0f} ms"
        f"{late}, over its {budget_ms:.0f} ms budget",
    )
