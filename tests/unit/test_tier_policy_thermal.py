"""``decide`` with the opt-in ``max_temp_c``: a lighter tier before thermal throttling, no upgrade while hot."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from edge_agent.config import SlaConfig
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import THERMAL_MARGIN_C, Policy, Snapshot, TierState, decide, policy_from_config

P = Policy(target_ms=100.0, min_samples=5, min_dwell_s=30.0, cooldown_s=60.0, upgrade_after=2, max_temp_c=80.0)
FAST = 50.0  # well under upgrade_ratio x target: an upgrade on latency alone
T0 = 1000.0


@pytest.mark.parametrize(
    ("temp", "tier", "entered", "value", "count", "pinned", "policy", "action", "tier_after"),
    [
        # at or over max_temp_c, dwelled: one tier lighter whatever the latency (even with no samples)
        (80.0, 0, T0 - 31, FAST, 50, None, P, "downgrade", 1),
        (85.0, 0, T0 - 31, None, 0, None, P, "downgrade", 1),
        (85.0, 1, T0 - 31, FAST, 50, None, P, "downgrade", 2),
        # not dwelled yet: the last step has not had time to cool the device
        (85.0, 0, T0 - 10, FAST, 50, None, P, "hold", 0),
        # the lightest tier: nowhere lighter to go
        (90.0, 2, T0 - 300, FAST, 50, None, P, "hold", 2),
        # under max_temp_c: latency decides as before
        (79.9, 0, T0 - 31, FAST, 50, None, P, "hold", 0),
        # within the margin below max_temp_c: no upgrade although the latency would allow one
        (80.0 - THERMAL_MARGIN_C + 0.1, 1, T0 - 300, FAST, 50, None, replace(P, max_temp_c=80.0), "hold", 1),
        # cool enough: the usual upgrade
        (80.0 - THERMAL_MARGIN_C - 0.1, 1, T0 - 300, FAST, 50, None, P, "upgrade", 0),
        # no sensor, or the option off: temperature plays no part
        (None, 0, T0 - 31, FAST, 50, None, P, "hold", 0),
        (95.0, 0, T0 - 31, FAST, 50, None, replace(P, max_temp_c=None), "hold", 0),
        (95.0, 1, T0 - 300, FAST, 50, None, replace(P, max_temp_c=None), "upgrade", 0),
        # a fleet pin wins over temperature
        (95.0, 0, T0 - 300, FAST, 50, 0, P, "hold", 0),
    ],
)
def test_decide_with_max_temp_c(temp, tier, entered, value, count, pinned, policy, action, tier_after) -> None:
    state = TierState(tiers=3, tier=tier, entered_s=entered, under=1, pinned=pinned)
    d = decide(Snapshot(value, count, None, temp), state, policy, T0)
    assert (d.action, d.state.tier) == (action, tier_after), d.reason
    if action == "downgrade":
        assert "max_temp_c" in d.reason and d.state.entered_s == T0


def test_policy_from_config_carries_max_temp_c() -> None:
    assert policy_from_config(SlaConfig(), max_batch=2).max_temp_c is None
    assert policy_from_config(SlaConfig(max_temp_c=75), max_batch=2).max_temp_c == 75.0
    with pytest.raises(ValueError, match="max_temp_c"):
        SlaConfig(max_temp_c=-1)


class _Ladder:
    def __init__(self) -> None:
        self.tiers = [SimpleNamespace(name=n) for n in ("big", "mid", "small")]
        self.active = 0
        self.switching = False
        self.switched_to: list[int] = []

    def switch_to(self, index: int) -> bool:
        self.switched_to.append(index)
        self.active = index
        return True

    def __getattr__(self, name: str):  # relief knobs the controller may set: accepted and ignored
        return lambda *a, **k: None


def test_controller_reads_the_temperature_only_when_opted_in() -> None:
    now = [T0]
    reads = []

    def temperature() -> float:
        reads.append(now[0])
        return 90.0

    ladder = _Ladder()
    off = TierController(ladder, replace(P, max_temp_c=None), clock=lambda: now[0], temperature=temperature)
    off.state = replace(off.state, entered_s=T0 - 100)
    assert off.evaluate().action != "downgrade" and reads == []
    on = TierController(ladder, P, clock=lambda: now[0], temperature=temperature)
    on.state = replace(on.state, entered_s=T0 - 100)
    decision = on.evaluate()
    assert decision.action == "downgrade" and reads == [T0]
