"""How long a batch that found its device idle may still wait for company: an adaptive, bounded wait.

A fixed batching timeout charges every lone request the full wait, even when nobody else is coming.
``AdaptiveWait`` waits only when a batch-mate is actually expected within the slack the latency SLA
leaves, and learns that slack from the SLA itself:

- **arrival rate**: ``observe_arrival(t)`` keeps an exponentially weighted mean of the gaps between
  arrivals (one outlier gap counts at most ``gap_cap_factor`` × ``max_wait_s``);
- **slack (AIMD)**: ``on_latency(ms, sla_ms)`` grows the allowed wait by ``increase_s`` while the
  latency meets the SLA and multiplies it by ``decrease`` on a breach, within ``[0, max_wait_s]``
  (the configured batching timeout is the upper bound; it starts at ``initial_wait_s``, 0 by
  default: no wait until the SLA has shown room for one);
- **decision**: ``wait_s(now, waiting_since, free_slots)`` is 0 (start now) when the batch is full,
  the allowed wait is used up, there is no rate estimate yet, or the next arrival is expected after
  the allowed wait ends; otherwise the seconds until that expected arrival. An arrival re-plans, so a
  batch-mate that comes early ends the wait early; one that does not come costs at most the allowed
  wait.

Pure and single-threaded: the caller passes the clock and holds its own lock. Nothing here knows
about a workload; speech steps and LLM admissions use it alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaitState:
    """A snapshot of the rule's learnt values, for reports and tests."""

    allowed_s: float  # the current AIMD bound on a wait (≤ max_wait_s)
    mean_gap_s: float | None  # the arrival gap estimate (None: fewer than two arrivals seen)
    breaches: int
    met: int


class AdaptiveWait:
    """Arrival-rate estimate + AIMD slack: wait for a batch-mate only when one is expected in time."""

    def __init__(
        self,
        max_wait_s: float,
        *,
        initial_wait_s: float = 0.0,
        increase_s: float | None = None,
        decrease: float = 0.5,
        gap_alpha: float = 0.2,
        gap_cap_factor: float = 10.0,
    ) -> None:
        if max_wait_s < 0 or not 0 <= initial_wait_s <= max_wait_s:
            raise ValueError(f"AdaptiveWait: need 0 <= initial_wait_s ({initial_wait_s}) <= max_wait_s ({max_wait_s})")
        if not 0 <= decrease < 1:
            raise ValueError(f"AdaptiveWait: decrease must lie in [0, 1), got {decrease}")
        if not 0 < gap_alpha <= 1:
            raise ValueError(f"AdaptiveWait: gap_alpha must lie in (0, 1], got {gap_alpha}")
        self.max_wait_s = max_wait_s
        self.increase_s = max_wait_s / 16 if increase_s is None else increase_s
        if self.increase_s < 0:
            raise ValueError(f"AdaptiveWait: increase_s must be >= 0, got {increase_s}")
        self.decrease, self.gap_alpha = decrease, gap_alpha
        self._gap_cap = max(gap_cap_factor * max_wait_s, 1e-3)
        self.allowed_s = initial_wait_s
        self.mean_gap_s: float | None = None
        self.last_arrival: float | None = None
        self.breaches = 0
        self.met = 0

    def observe_arrival(self, t: float) -> None:
        """One request arrived at clock time ``t`` (seconds, non-decreasing)."""
        if self.last_arrival is not None:
            gap = min(max(0.0, t - self.last_arrival), self._gap_cap)
            if self.mean_gap_s is None:
                self.mean_gap_s = gap
            else:
                self.mean_gap_s += self.gap_alpha * (gap - self.mean_gap_s)
        self.last_arrival = t if self.last_arrival is None else max(self.last_arrival, t)

    def on_latency(self, ms: float, sla_ms: float) -> None:
        """One served request's latency against its SLA: additive increase if met, else multiplicative cut."""
        if ms <= sla_ms:
            self.met += 1
            self.allowed_s = min(self.max_wait_s, self.allowed_s + self.increase_s)
        else:
            self.breaches += 1
            self.allowed_s *= self.decrease

    def wait_s(self, now: float, waiting_since: float, free_slots: int) -> float:
        """Seconds the batch whose oldest request arrived at ``waiting_since`` should still wait for
        company with ``free_slots`` places left; 0: start it now."""
        left = self.allowed_s - (now - waiting_since)
        if free_slots <= 0 or left <= 0 or self.mean_gap_s is None or self.last_arrival is None:
            return 0.0
        expected = self.last_arrival + self.mean_gap_s
        if expected <= now:  # overdue: arrivals are not due at fixed times, so one more mean gap from now
            expected = now + self.mean_gap_s
        until = expected - now
        return until if until <= left else 0.0

    def state(self) -> WaitState:
        return WaitState(self.allowed_s, self.mean_gap_s, self.breaches, self.met)
