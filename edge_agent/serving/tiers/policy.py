"""The tier policy: the controller's decision, a pure function of a latency snapshot, the state and
the policy, and the policy itself from the configuration (``policy_from_config``, both workloads).

``decide(snapshot, state, policy, now)`` is called once per evaluation (every ``evaluate_every_s``)
with the SLA metric's percentile over the rolling window. It never sleeps, reads a clock or touches
an engine: the caller applies the returned state (``serving/tiers/control.py``), and the tests drive it
with a fake clock.

Rules, in order:
- a fleet pin wins: go to the pinned tier at once (no samples needed) and stay there until unpinned;
- pressure (no samples needed: it is predicted, and refused requests leave none): at least
  ``pressure_min`` arrivals predicted over their budget within ``PRESSURE_S`` (one, by default: the first
  request the tier cannot serve within its budget) and ``min_dwell_s`` in the tier: move one tier lighter
  at once, remembering the throughput at which the tier broke (below) when the window has the samples to
  measure one (a lone arrival over budget at a light load leaves none); while any are, no upgrade;
- fewer than ``min_samples`` samples: no switch (the window is noise), with three exceptions, because
  a shedding or idle device produces no samples and would otherwise never change again:
  - just unpinned (``released``): go back to the top tier, the ladder's starting point; with enough
    samples the usual rules below decide instead;
  - shedding or truncating, and ``cooldown_s`` since either last tightened: lift both (a "probe"), so
    that requests are admitted and measured again; a load still over target brings them back;
  - otherwise hold;
- over target for ``downgrade_after`` consecutive evaluations and at least ``min_dwell_s`` in the tier:
  move one tier lighter;
- under ``upgrade_ratio × target`` for ``upgrade_after`` consecutive evaluations, ``cooldown_s`` since
  the last switch and the dwell time: move one tier heavier. The gap between the two thresholds is the
  hysteresis that keeps a noisy but steady load from flapping. A light tier being fast says nothing
  about whether the heavy one can take the load, so a downgrade remembers the throughput at which
  the tier broke, and the way back up waits until the load is below ``upgrade_ratio`` of it (the
  memory fades after ``forget_after_s``: other prompts may change what a tier can take).
Besides switching, over target with no lighter tier to go to (the lightest, or pinned): halve the
``max_new_tokens`` cap (stream truncation) down to ``min_token_cap_ratio``; still over after
``shed_after`` more evaluations at the floor: shed new requests with a clear rejection. Shedding is
bounded: ``cooldown_s`` after it began it stops (a probe) even while the window is still over target,
and starts again only after ``shed_after`` more evaluations over target. Comfortably under target
again (< 0.9 × target) undoes them step by step. The batch size follows the AIMD rule (halve above
1.1 × target, double below 0.9 ×, within bounds) when ``adaptive_batch`` is on.
Temperature (opt-in ``max_temp_c``, unpinned only): at or above it, after ``min_dwell_s`` in the tier,
move one tier lighter whatever the latency says (throttling would soon slow every request); within
``THERMAL_MARGIN_C`` of it, no upgrade.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from ...config import AsrSlaConfig, SlaConfig

# No way back up while within this many degrees of max_temp_c: the heavier tier would heat it again.
THERMAL_MARGIN_C = 5.0
PRESSURE_S = 5.0  # arrivals predicted over budget count as pressure for this long

Action = Literal["hold", "downgrade", "upgrade", "pin", "unpin", "probe", "insufficient"]


DEFAULT_SPILL_TTFT_MS = 387.0  # the default SLA's first-token target (config.sla.SLA_PRESETS["default"])


@dataclass(frozen=True, slots=True)
class Policy:
    """What the controller aims for (metric, percentile, target) and how it gets there (hysteresis,
    relief); ``policy_from_config`` makes one from ``[sla]`` or ``[sla.asr]``."""

    metric: str = "ttft_ms"
    percentile: float = 95.0
    target_ms: float = 387.0
    min_samples: int = 20
    downgrade_after: int = 3
    upgrade_after: int = 6
    upgrade_ratio: float = 0.7
    cooldown_s: float = 60.0
    min_dwell_s: float = 30.0
    adaptive_batch: bool = False
    min_batch: int = 1
    max_batch: int = 4
    min_token_cap_ratio: float = 0.25
    shed_after: int = 3
    forget_after_s: float = 600.0
    pressure_min: int = 1  # arrivals predicted over budget (within PRESSURE_S) that move to a lighter tier
    max_temp_c: float | None = None  # opt-in: step down before the kernel throttles (None: temperature ignored)
    spill_ttft_ms: float | None = (
        None  # the spill's own first-token threshold (None: ``spill_threshold_ms`` derives it)
    )

    @property
    def spill_threshold_ms(self) -> float:
        """The expected first-token time above which a busy one-sequence tier (the NPU) hands a request to
        the tier beside it: ``spill_ttft_ms`` when set; else the target when the metric bounds the first
        token (``ttft_ms``; ``e2e_ms``, which a later first token misses too); else (``itl_ms``, ``tpot_ms``,
        which a wait in the queue does not change) the default first-token target, ``DEFAULT_SPILL_TTFT_MS``."""
        if self.spill_ttft_ms is not None:
            return self.spill_ttft_ms
        return self.target_ms if self.metric in ("ttft_ms", "e2e_ms") else DEFAULT_SPILL_TTFT_MS


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The SLA metric over the window: its percentile (None when empty), the sample count and the
    completed requests per second (None when unknown)."""

    value_ms: float | None
    count: int
    rate_per_s: float | None = None
    temp_c: float | None = None  # the hottest sensor now (telemetry.health); None when none is readable
    over_budget: int = 0  # arrivals predicted over their first-token budget within PRESSURE_S (admission)
    arrivals: int = 0  # arrivals judged by admission within PRESSURE_S


@dataclass(frozen=True, slots=True)
class TierState:
    """Where the ladder is and the streaks, relief and pin that the next decision starts from."""

    tiers: int  # ladder length; tier 0 is the heaviest
    tier: int = 0
    entered_s: float = -math.inf  # when the current tier became active
    over: int = 0  # consecutive evaluations over target
    under: int = 0  # consecutive evaluations under upgrade_ratio × target
    batch: int | None = None  # adaptive max batch (None: not adapting)
    token_cap_ratio: float = 1.0  # fraction of the tier's max_new_tokens allowed
    over_at_floor: int = 0  # consecutive evaluations over target with the token cap at its floor
    shedding: bool = False
    relief_s: float = -math.inf  # when the token cap was last lowered or shedding began
    pinned: int | None = None
    released: bool = False  # unpinned, and no evaluation has decided where to go since
    broke_at: tuple[tuple[int, float, float], ...] = ()  # (tier, requests/s, when) at each downgrade


@dataclass(frozen=True, slots=True)
class Decision:
    """The next state, what it does (``action``) and why (``reason``, logged and sent in events)."""

    state: TierState
    action: Action
    reason: str

    @property
    def switched(self) -> bool:
        return self.action in ("downgrade", "upgrade", "pin", "unpin")

    @property
    def fresh_window(self) -> bool:
        """The samples so far say nothing about what comes next: a new tier, or admission reopened."""
        return self.switched or self.action == "probe"


def decide(snapshot: Snapshot, state: TierState, policy: Policy, now: float) -> Decision:
    p = policy
    if state.pinned is not None and state.tier != state.pinned:
        return Decision(
            _switch(replace(state, released=False), state.pinned, now),
            "pin",
            f"pinned to tier {state.pinned} by the fleet",
        )
    hot = False
    if p.max_temp_c is not None and snapshot.temp_c is not None and state.pinned is None:
        if snapshot.temp_c >= p.max_temp_c and state.tier < state.tiers - 1 and now - state.entered_s >= p.min_dwell_s:
            return Decision(
                _switch(replace(state, released=False), state.tier + 1, now),
                "downgrade",
                f"temperature {snapshot.temp_c:.1f} °C >= max_temp_c {p.max_temp_c:g} °C: "
                f"a lighter tier before thermal throttling slows every request",
            )
        hot = snapshot.temp_c > p.max_temp_c - THERMAL_MARGIN_C
    if (
        snapshot.over_budget >= p.pressure_min
        and state.pinned is None
        and state.tier < state.tiers - 1
        and now - state.entered_s >= p.min_dwell_s
    ):
        return Decision(
            _switch(_broke(replace(state, released=False), snapshot, now, p), state.tier + 1, now),
            "downgrade",
            f"{snapshot.over_budget} of {snapshot.arrivals} arrivals in {PRESSURE_S:g} s predicted over their "
            f"first-token budget",
        )
    value = snapshot.value_ms
    if value is None or snapshot.count < p.min_samples:
        return _without_samples(snapshot, state, p, now)
    label = f"{p.metric} P{p.percentile:g} {value:.0f} ms"
    over = value > p.target_ms
    under = value < p.upgrade_ratio * p.target_ms and snapshot.over_budget == 0
    s = replace(state, over=state.over + 1 if over else 0, under=state.under + 1 if under else 0, released=False)
    s = _adapt_batch(s, p, value)
    dwelled = now - s.entered_s >= p.min_dwell_s

    if s.pinned is not None:
        return _relieve(s, p, value, now, f"pinned to tier {s.pinned}; {label}")
    if over and s.over >= p.downgrade_after and s.tier < s.tiers - 1 and dwelled:
        return Decision(
            _switch(_broke(s, snapshot, now, p), s.tier + 1, now),
            "downgrade",
            f"{label} > target {p.target_ms:g} ms for {s.over} evaluations",
        )
    if (
        under
        and s.under >= p.upgrade_after
        and s.tier > 0
        and dwelled
        and not hot
        and now - s.entered_s >= p.cooldown_s
    ):
        limit = next(
            (rate for tier, rate, at in s.broke_at if tier == s.tier - 1 and now - at < p.forget_after_s), None
        )
        if limit is not None and (snapshot.rate_per_s is None or snapshot.rate_per_s >= p.upgrade_ratio * limit):
            load = "unknown" if snapshot.rate_per_s is None else f"{snapshot.rate_per_s:.2f} req/s"
            return _relieve(
                s,
                p,
                value,
                now,
                f"{label}, but load {load} is not below {p.upgrade_ratio:g} × the {limit:.2f} req/s "
                f"at which tier {s.tier - 1} broke",
            )
        return Decision(
            _switch(s, s.tier - 1, now), "upgrade", f"{label} < {p.upgrade_ratio:g} × target for {s.under} evaluations"
        )
    return _relieve(s, p, value, now, label)


def _without_samples(snapshot: Snapshot, state: TierState, p: Policy, now: float) -> Decision:
    """Too few samples to judge the load by. Nothing is measured while shedding, nor on an idle
    device, so waiting for samples alone would keep the relief (or the pinned tier) forever."""
    few = f"{snapshot.count} {p.metric} samples in the window, fewer than min_samples {p.min_samples}"
    if state.released:
        s = replace(state, released=False)
        if s.tier > 0:
            return Decision(_switch(s, 0, now), "unpin", f"unpinned by the fleet with {few}: back to the top tier")
        return Decision(s, "insufficient", few)
    relieved = state.shedding or state.token_cap_ratio < 1.0
    if relieved and now - state.relief_s >= p.cooldown_s:
        return Decision(
            replace(state, shedding=False, token_cap_ratio=1.0, over_at_floor=0, relief_s=now),
            "probe",
            f"{few} {now - state.relief_s:.0f} s after shedding or truncation began "
            f"(cooldown {p.cooldown_s:g} s): both lifted, to measure the load again",
        )
    return Decision(state, "insufficient", few)


def _broke(s: TierState, snapshot: Snapshot, now: float, p: Policy) -> TierState:
    """``s`` remembering that its tier broke now, at the throughput ``snapshot`` measured, when it measured one
    on at least ``min_samples`` (a lone arrival predicted over budget at a light load, a voice turn's
    moment, says nothing about the load the tier can take: the way back up is then the usual one)."""
    broke = tuple(b for b in s.broke_at if b[0] != s.tier)
    if snapshot.rate_per_s is not None and snapshot.count >= p.min_samples:
        broke += ((s.tier, snapshot.rate_per_s, now),)
    return replace(s, broke_at=broke)


def _switch(s: TierState, tier: int, now: float) -> TierState:
    # A new tier starts with fresh streaks and no truncation or shedding: its latency is unknown yet.
    return replace(s, tier=tier, entered_s=now, over=0, under=0, token_cap_ratio=1.0, over_at_floor=0, shedding=False)


def _relieve(s: TierState, p: Policy, value: float, now: float, label: str) -> Decision:
    """No switch this time: with no lighter tier left, truncate, then shed, while over target;
    undo both when well under. Shedding lasts at most ``cooldown_s`` at a time."""
    stuck = s.pinned is not None or s.tier == s.tiers - 1
    if value > p.target_ms and stuck:
        if s.shedding and now - s.relief_s >= p.cooldown_s:
            # The window may be stale (nothing new is admitted); admit again and measure.
            return Decision(
                replace(s, shedding=False, over_at_floor=0, relief_s=now),
                "probe",
                f"{label} > target {p.target_ms:g} ms, but shedding for {now - s.relief_s:.0f} s "
                f"(cooldown {p.cooldown_s:g} s): admitting again; shedding resumes after "
                f"{p.shed_after} more evaluations over target",
            )
        if s.token_cap_ratio > p.min_token_cap_ratio:
            return Decision(
                replace(
                    s, token_cap_ratio=max(p.min_token_cap_ratio, s.token_cap_ratio / 2), over_at_floor=0, relief_s=now
                ),
                "hold",
                label,
            )
        at_floor = s.over_at_floor + 1
        shed = s.shedding or at_floor >= p.shed_after
        return Decision(
            replace(s, over_at_floor=at_floor, shedding=shed, relief_s=s.relief_s if s.shedding or not shed else now),
            "hold",
            label,
        )
    if value < 0.9 * p.target_ms:
        if s.shedding:
            return Decision(replace(s, shedding=False, over_at_floor=0), "hold", label)
        return Decision(replace(s, token_cap_ratio=min(1.0, s.token_cap_ratio * 2), over_at_floor=0), "hold", label)
    return Decision(replace(s, over_at_floor=0), "hold", label)


def _adapt_batch(s: TierState, p: Policy, value: float) -> TierState:
    if not p.adaptive_batch:
        return s
    batch = s.batch if s.batch is not None else p.max_batch
    if value > 1.1 * p.target_ms:
        batch = max(p.min_batch, batch // 2)
    elif value < 0.9 * p.target_ms:
        batch = min(p.max_batch, batch * 2)
    return replace(s, batch=batch)


def policy_from_config(sla: SlaConfig | AsrSlaConfig, max_batch: int | None = None) -> Policy:
    """The controller's policy from ``[sla]`` (``config.SlaConfig``, the LLM; ``max_batch``: the largest
    batch of its tiers) or ``[sla.asr]`` (``config.AsrSlaConfig``). ASR has no tokens to cap and its
    batch stays as configured: ``min_token_cap_ratio = 1`` sends an over-target lightest tier straight
    to counting towards shedding."""
    relief: dict = {"adaptive_batch": False, "min_token_cap_ratio": 1.0}
    if isinstance(sla, SlaConfig):
        if max_batch is None:
            raise ValueError("the LLM policy needs max_batch, the largest batch of its tiers")
        relief = {
            "adaptive_batch": sla.adaptive_batch == "on"
            or (sla.adaptive_batch == "auto" and sla.metric in ("itl_ms", "tpot_ms")),
            "min_batch": min(sla.min_batch, max_batch),
            "max_batch": max_batch,
            "min_token_cap_ratio": sla.min_token_cap_ratio,
            "max_temp_c": sla.max_temp_c,
            "spill_ttft_ms": sla.spill_ttft_ms,
        }
    return Policy(metric=sla.metric, target_ms=sla.target_ms, **knobs(sla), **relief)


# The percentile, sample count and hysteresis every workload's policy takes from its config section
# (``config.sla``), as the benchmarks report them.
KNOBS = (
    "percentile",
    "min_samples",
    "downgrade_after",
    "upgrade_after",
    "upgrade_ratio",
    "cooldown_s",
    "min_dwell_s",
    "shed_after",
)


def knobs(policy) -> dict:
    """``KNOBS`` of a ``Policy`` or of an SLA config section."""
    return {k: getattr(policy, k) for k in KNOBS}


def overlay(policy: Policy, sla) -> Policy:
    """``policy`` with the fleet's SLA (``telemetry.schema.SlaSpec``) on top; the hysteresis stays the file's."""
    return replace(
        policy, metric=sla.metric, percentile=sla.percentile, target_ms=sla.target_ms, min_samples=sla.min_samples
    )
