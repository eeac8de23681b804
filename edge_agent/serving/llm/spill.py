"""The spill decision: whether a one-sequence tier (the NPU's LLM mode) takes a request or the tier loaded
beside it does. Pure: the caller passes the clock's reading, the work already on the tier and its rates.

- An idle tier (nothing waiting, running or being handed over) takes every request it can hold: a slow
  request never retires it, since its next request measures it again.
- A busy tier takes a request only when its expected first token is within ``threshold_ms``: the work
  ahead of it (each sequence's prompt still to prefill and tokens still to come, at the tier's recent
  milliseconds per prompt token and per generated token) plus its own prefill. With no recent rates (none
  measured yet, or older than ``STALE_S``) a busy tier's wait cannot be told, and the request goes beside.
- ``threshold_ms`` None: the tier takes what it can hold, queueing behind what it runs.

``Rates`` learns per token, so a long prompt's slow first token says nothing about a short prompt's, and
each rate ages out: a sample after ``STALE_S`` without one replaces it rather than averaging with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...metrics.timing import RequestTiming

STALE_S = 60.0  # a rate not refreshed for this long no longer describes the tier (thermal state, other load)
EWMA = 0.2  # weight of the newest request in a fresh rate


@dataclass(frozen=True, slots=True)
class Work:
    """One sequence's work left on a tier: prompt tokens still to prefill, tokens still to generate."""

    prompt_tokens: int
    new_tokens: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the one-sequence tier takes the request; why not (the handle's ``spill`` reason) when it does not."""

    take: bool
    expected_ms: float | None = None  # the expected first-token time on the tier, when one was estimated
    reason: str | None = None


class Rates:
    """A tier's recent milliseconds per prompt token prefilled and per token generated (see the module doc).
    Not thread-safe by itself: the ladder updates and reads it under its lock."""

    def __init__(self) -> None:
        self.prefill_ms_per_token: float | None = None
        self.decode_ms_per_token: float | None = None
        self.prefill_at_s = self.decode_at_s = float("-inf")

    def learn(self, timing: RequestTiming) -> None:
        """One finished request's prefill and decode times, at its finish time (the serving clock's)."""
        now = timing.finished_s
        prefilled = timing.tokens_in - timing.cached_tokens
        if timing.prefill_ms is not None and prefilled > 0:
            self.prefill_ms_per_token = _blend(
                self.prefill_ms_per_token, self.prefill_at_s, timing.prefill_ms / prefilled, now
            )
            self.prefill_at_s = now
        times = timing.token_times_s
        if len(times) > 1:
            per_token = (times[-1] - times[0]) * 1e3 / (len(times) - 1)
            self.decode_ms_per_token = _blend(self.decode_ms_per_token, self.decode_at_s, per_token, now)
            self.decode_at_s = now

    def current(self, now: float) -> tuple[float, float] | None:
        """(ms per prompt token, ms per generated token), or None when either is unknown or stale."""
        if self.prefill_ms_per_token is None or self.decode_ms_per_token is None:
            return None
        if now - min(self.prefill_at_s, self.decode_at_s) > STALE_S:
            return None
        return self.prefill_ms_per_token, self.decode_ms_per_token


def _blend(old: float | None, old_at_s: float, new: float, now: float) -> float:
    if old is None or now - old_at_s > STALE_S:
        return new  # nothing recent to average with
    return old + EWMA * (new - old)


def decide(
    ahead: Sequence[Work], request: Work, rates: tuple[float, float] | None, threshold_ms: float | None
) -> Verdict:
    """Whether the one-sequence tier takes ``request`` with ``ahead`` on it (see the module doc)."""
    if not ahead or threshold_ms is None:
        return Verdict(True)
    if rates is None:
        return Verdict(False, None, f"queue: {len(ahead)} request(s) ahead and no recent timing to wait on")
    prefill, decode = rates
    expected = sum(w.prompt_tokens * prefill + w.new_tokens * decode for w in ahead) + request.prompt_tokens * prefill
    if expected > threshold_ms:
        return Verdict(False, expected, f"queue: expected first token in {expected:.0f} ms > {threshold_ms:.0f} ms")
    return Verdict(True, expected)
