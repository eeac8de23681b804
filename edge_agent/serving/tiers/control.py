"""The tier controller loop: observe finished requests, ask ``tier_policy.decide``, apply the decision.

Every ``evaluate_every_s`` it takes the SLA metric's percentile over a rolling window of the active
tier's requests (a switch starts a fresh window, and each tier's first request after loading is
excluded), calls the pure ``decide``, and applies the result to the served ladder: switch, truncate,
shed, resize the batch. The same loop serves both workloads: register ``observe`` with the agent's
``observe.Observers`` and it keeps the observations of its own workload's active tier (an LLM
request, an ASR utterance, the same record); token caps and batch sizes are applied only where the
policy can ask for them (an ASR policy never does). Each switch is reported as a ``tier_switch``
event with its reason and the snapshot that caused it; a fleet pin (``pin``/``unpin``) overrides
the controller until removed, and an unpin with too few samples to judge by goes back to the top
tier. Pressure is an input beside the samples: the ladder's admission counts (``pressure()``: arrivals,
those predicted over budget, refusals), kept for ``tier_policy.PRESSURE_S``; an arrival predicted over
budget ``poke``s the loop, which then evaluates at once (at most every ``POKE_GAP_S``) instead of
waiting for its period: a switch comes within a second of the pressure, not after a window of samples.
``set_policy`` (a new SLA from the file or the fleet) lifts truncation and shedding: they were
decided against the old target.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from ...metrics.window import RollingWindow
from ...observe import Observation
from .policy import PRESSURE_S, Decision, Policy, Snapshot, TierState, decide

log = logging.getLogger(__name__)
POKE_GAP_S = 0.25  # evaluations a poke asks for are at least this far apart


class Named(Protocol):
    """A tier: the controller only needs its name."""

    @property
    def name(self) -> str: ...


class Served(Protocol):
    """A ladder the controller drives (``serving.tier_ladder.Ladder``: ``TieredLLM``, ``TieredSpeech``)."""

    @property
    def tiers(self) -> Sequence[Named]: ...
    def relieve(self, shedding: bool, token_cap_ratio: float | None = None) -> None: ...
    @property
    def active(self) -> int: ...
    @property
    def switching(self) -> bool: ...
    def switch_to(self, index: int) -> bool: ...
    def set_max_batch(self, max_batch: int) -> None: ...


class TierController:
    """The loop that keeps one workload's ladder within its SLA (see the module doc): ``observe``
    feeds the window, ``evaluate`` (every ``evaluate_every_s`` on its own thread) decides and applies;
    ``pin``/``unpin``/``set_policy`` are the fleet's and the file's levers."""

    def __init__(
        self,
        served: Served,
        policy: Policy,
        window_s: float = 30.0,
        evaluate_every_s: float = 10.0,
        on_event: Callable[[str, dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        workload: str = "llm",
        temperature: Callable[[], float | None] | None = None,
        pressure: Callable[[], Any] | None = None,
    ) -> None:
        """``temperature()``: the hottest sensor in °C (or None), read each evaluation when the policy
        sets ``max_temp_c``."""
        self.served, self.policy, self.workload = served, policy, workload
        self._temperature = temperature
        self.window_s, self.evaluate_every_s = window_s, evaluate_every_s
        self._clock = clock
        self._on_event = on_event or (lambda kind, payload: None)
        self._lock = threading.Lock()
        self.window = RollingWindow(window_s, clock=clock)
        self._window_started = clock()
        self.state = TierState(tiers=len(served.tiers), tier=served.active, entered_s=self._window_started)
        self.last: Decision | None = None
        # Who set the policy and the pin state: "file", "command" or "desired@<version>" (reported.sources).
        self.sla_source, self.pin_source = "file", "file"
        self._stop = threading.Event()
        self._poked = threading.Event()
        self._thread: threading.Thread | None = None
        self._pressure = pressure  # () -> counts since the last call (arrivals, over_budget, refused)
        self._pressed: deque[tuple[float, int, int]] = deque()  # (when, arrivals, over budget) per evaluation

    # -- inputs ----------------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        """Record one finished request or utterance (an ``Observers`` consumer); only the active
        tier of this controller's workload counts."""
        active = self.served.tiers[self.state.tier].name
        if obs.workload != self.workload or active not in (obs.tier, obs.spilled_from):
            # work finishing on a tier being drained says nothing about the new one; a request the active
            # tier handed to its spill tier is what the active tier gave it
            return
        values = obs.samples.get(self.policy.metric, ())
        if values:
            self.window.record_many(self.policy.metric, values, obs.tags)
        self.window.record("requests", 1.0)  # throughput counts every request, warm-up or not

    def pin(self, tier: int | str, source: str = "command") -> None:
        """Go to ``tier`` now (no samples needed) and stay there until ``unpin``."""
        index = self._index(tier)
        with self._lock:
            self.state = replace(self.state, pinned=index, released=False)
            self.pin_source = source
        self.evaluate()

    def unpin(self, source: str = "command") -> None:
        """Give control back: the next evaluation decides with the usual rules, or, with fewer than
        ``min_samples`` samples (an idle device), returns to the top tier."""
        with self._lock:
            if self.state.pinned is not None:
                self.state = replace(self.state, pinned=None, released=True)
            self.pin_source = source

    def set_policy(self, policy: Policy, window_s: float | None = None, source: str = "file") -> bool:
        """Apply a new SLA policy (and window). A change starts a fresh window and lifts truncation and
        shedding, which answered the old target; returns whether anything changed."""
        window_s = self.window_s if window_s is None else window_s
        with self._lock:
            self.sla_source = source
            if policy == self.policy and window_s == self.window_s:
                return False
            self.policy, self.window_s = policy, window_s
            self.state = replace(self.state, over=0, under=0, token_cap_ratio=1.0, over_at_floor=0, shedding=False)
            self.window = RollingWindow(window_s, clock=self._clock)
            self._window_started = self._clock()
        self.served.relieve(False, 1.0 if policy.min_token_cap_ratio < 1.0 else None)
        return True

    def _index(self, tier: int | str) -> int:
        names = [t.name for t in self.served.tiers]
        if isinstance(tier, int) and 0 <= tier < len(names):
            return tier
        if tier in names:
            return names.index(tier)
        raise ValueError(f"unknown tier {tier!r}; the {self.workload} tiers are {names}")

    # -- the loop ----------------------------------------------------------------------------

    def _read_temperature(self) -> float | None:
        if self._temperature is None:
            return None
        try:
            return self._temperature()
        except Exception:  # a sensor that fails reads as absent: the latency rules still apply
            log.warning("%s controller: the temperature could not be read", self.workload, exc_info=True)
            return None

    def poke(self) -> None:
        """Pressure: evaluate now rather than at the next period (any thread; it only sets a flag)."""
        self._poked.set()

    def _read_pressure(self, now: float) -> tuple[int, int]:
        """(arrivals, over budget) within ``PRESSURE_S``."""
        if self._pressure is not None:
            counts = self._pressure()
            self._pressed.append((now, counts.arrivals, counts.over_budget))
        while self._pressed and now - self._pressed[0][0] > PRESSURE_S:
            self._pressed.popleft()
        return sum(a for _, a, _ in self._pressed), sum(o for _, _, o in self._pressed)

    def evaluate(self) -> Decision:
        now = self._clock()
        p = self.policy
        arrivals, over_budget = self._read_pressure(now)
        values = self.window.values(p.metric, now)
        # Requests completed per second over the window (one sample each for per-request metrics).
        requests = self.window.count("requests", now)
        span = min(self.window_s, max(now - self._window_started, 1e-9))
        snap = Snapshot(
            self.window.percentile(p.metric, p.percentile, now),
            len(values),
            requests / span,
            self._read_temperature() if p.max_temp_c is not None else None,
            over_budget,
            arrivals,
        )
        with self._lock:
            state = self.state
            decision = decide(snap, state, p, now)
            if decision.switched and self.served.switching:
                decision = Decision(state, "hold", "a tier switch is still loading or draining")
            self.state, self.last = decision.state, decision
        if decision.action == "probe":  # admission reopens: only what is admitted from now on counts
            self.window = RollingWindow(self.window_s, clock=self._clock)
            self._window_started = now
            log.info("%s tier %s: %s", self.workload, self.served.tiers[decision.state.tier].name, decision.reason)
        if decision.switched:
            old = state.tier
            self._pressed.clear()  # it judged the tier left behind
            self.window = RollingWindow(self.window_s, clock=self._clock)
            self._window_started = now
            # The event goes out before the load starts: a load that fails at once reports its
            # tier_switch_failed after the switch it belongs to, not before.
            self._on_event(
                "tier_switch",
                {
                    "workload": self.workload,
                    "from": self.served.tiers[old].name,
                    "to": self.served.tiers[decision.state.tier].name,
                    "action": decision.action,
                    "reason": decision.reason,
                    "snapshot": {
                        "metric": p.metric,
                        "percentile": p.percentile,
                        "value_ms": snap.value_ms,
                        "count": snap.count,
                        "rate_per_s": snap.rate_per_s,
                        "target_ms": p.target_ms,
                        "window_s": self.window_s,
                        "arrivals": arrivals,
                        "over_budget": over_budget,
                    },
                },
            )
            self.served.switch_to(decision.state.tier)
        # a policy that can truncate (LLM) sets the token cap; one that cannot (ASR) leaves it alone
        cap = decision.state.token_cap_ratio if p.min_token_cap_ratio < 1.0 else None
        self.served.relieve(decision.state.shedding, cap)
        if decision.state.batch is not None:  # only with adaptive_batch
            self.served.set_max_batch(decision.state.batch)
        return decision

    def switch_failed(self, old: int, new: int, error: str) -> None:
        """The served tier could not load ``new``: stay on ``old`` and say so."""
        with self._lock:
            self.state = replace(self.state, tier=old)
        self._on_event(
            "tier_switch_failed",
            {
                "workload": self.workload,
                "from": self.served.tiers[old].name,
                "to": self.served.tiers[new].name,
                "error": error,
            },
        )

    def start(self) -> TierController:
        self._thread = threading.Thread(target=self._loop, name=f"tiers-{self.workload}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        next_at = time.monotonic() + self.evaluate_every_s
        while not self._stop.is_set():
            poked = self._poked.wait(max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                return
            self._poked.clear()
            try:
                self.evaluate()
            except Exception:  # the controller must never take serving down
                log.exception("tier evaluation failed")
            if poked:
                self._stop.wait(POKE_GAP_S)
            else:
                next_at = time.monotonic() + self.evaluate_every_s

    def stop(self) -> None:
        self._stop.set()
        self._poked.set()
        if self._thread is not None:
            self._thread.join(5)
