"""Table tests of serving.tiers.policy.decide with a fake clock: hysteresis, cooldown, dwell, min samples, pinning,
truncation and shedding, AIMD batch, and no flapping under a noisy but steady load."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from edge_agent.serving.tiers.policy import Decision, Policy, Snapshot, TierState, decide

POLICY = Policy(
    target_ms=100.0,
    min_samples=20,
    downgrade_after=3,
    upgrade_after=4,
    upgrade_ratio=0.7,
    cooldown_s=30.0,
    min_dwell_s=10.0,
)


def run(values, state=None, policy=POLICY, start=100.0, step_s=5.0, count=50) -> list[Decision]:
    """Feed one evaluation per ``step_s`` of the fake clock; returns every decision."""
    state = state or TierState(tiers=3, entered_s=0.0)
    out = []
    for i, v in enumerate(values):
        d = decide(Snapshot(v, count), state, policy, start + i * step_s)
        out.append(d)
        state = d.state
    return out


def tiers(decisions) -> list[int]:
    return [d.state.tier for d in decisions]


@pytest.mark.parametrize(
    "values, expected",
    [
        ([150, 150, 150], [0, 0, 1]),  # N=3 consecutive windows over target
        ([150, 150, 90, 150, 150], [0, 0, 0, 0, 0]),  # a good window resets the streak
        ([150] * 7, [0, 0, 1, 1, 1, 2, 2]),  # again N more windows in the new tier; then the lightest
        ([150] * 12, [0, 0, 1, 1, 1, 2] + [2] * 6),  # never beyond the lightest tier
    ],
)
def test_downgrade_after_n_windows_over_target(values, expected):
    assert tiers(run(values)) == expected


def test_no_decision_under_min_samples_and_streaks_untouched():
    state = TierState(tiers=3, entered_s=0.0, over=2)
    d = decide(Snapshot(500.0, 19), state, POLICY, 100.0)
    assert d.action == "insufficient" and d.state == state and "min_samples 20" in d.reason
    d = decide(Snapshot(None, 0), state, POLICY, 100.0)
    assert d.action == "insufficient" and d.state == state


def test_dwell_time_delays_a_downgrade():
    policy = replace(POLICY, min_dwell_s=60.0)
    decisions = run([150] * 6, state=TierState(tiers=3, entered_s=90.0), policy=policy, step_s=5.0)
    # evaluations at t=100..125: dwell reached at 150 -> none of them switch
    assert tiers(decisions) == [0] * 6
    later = decide(Snapshot(150, 50), decisions[-1].state, policy, 150.0)
    assert later.action == "downgrade" and "for 7 evaluations" in later.reason


def test_upgrade_needs_m_windows_under_ratio_and_the_cooldown():
    start = TierState(tiers=3, tier=2, entered_s=100.0)
    # under 0.7 × target from t=100 on, every 5 s: M=4 reached at t=115 but cooldown (30 s) only at t=130
    decisions = run([50] * 8, state=start, start=100.0)
    assert [d.action for d in decisions].index("upgrade") == 6  # t = 130
    assert decisions[6].state.tier == 1 and decisions[6].state.entered_s == 130.0


def test_hysteresis_band_holds_between_upgrade_ratio_and_target():
    decisions = run([80, 95, 75, 99] * 10, state=TierState(tiers=3, tier=1, entered_s=0.0))
    assert {d.action for d in decisions} == {"hold"} and set(tiers(decisions)) == {1}


def test_noisy_but_steady_load_does_not_flap():
    rng = random.Random(7)
    # P95 hovering around 85% of target with ±20% noise: some windows over, some under 0.7×
    values = [100 * 0.85 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(400)]
    decisions = run(values, state=TierState(tiers=3, tier=1, entered_s=0.0))
    switches = [d for d in decisions if d.switched]
    assert len(switches) <= 1, [(d.action, d.reason) for d in switches]


def test_pin_overrides_the_controller_until_unpinned():
    state = TierState(tiers=3, tier=0, entered_s=0.0, pinned=2)
    d = decide(Snapshot(10, 50), state, POLICY, 100.0)
    assert d.action == "pin" and d.state.tier == 2
    held = run([10] * 20, state=d.state)
    assert set(tiers(held)) == {2} and all(x.action == "hold" for x in held)
    free = run([10] * 20, state=replace(held[-1].state, pinned=None), start=300.0)
    assert free[-1].state.tier < 2


def test_at_the_lightest_tier_truncate_then_shed_then_recover():
    state = TierState(tiers=2, tier=1, entered_s=0.0)
    policy = replace(POLICY, min_token_cap_ratio=0.25, shed_after=2)
    over = run([300] * 5, state=state, policy=policy)
    assert [d.state.token_cap_ratio for d in over] == [0.5, 0.25, 0.25, 0.25, 0.25]
    assert [d.state.shedding for d in over] == [False, False, False, True, True]
    calm = run([50] * 3, state=over[-1].state, policy=policy, start=200.0)
    assert [(d.state.shedding, d.state.token_cap_ratio) for d in calm] == [(False, 0.25), (False, 0.5), (False, 1.0)]


def test_no_truncation_while_a_lighter_tier_is_still_available():
    d = run([300, 300], state=TierState(tiers=3, tier=0, entered_s=0.0))
    assert all(x.state.token_cap_ratio == 1.0 and not x.state.shedding for x in d)


@pytest.mark.parametrize(
    "value, batch, expected",
    [
        (115, 8, 4),
        (115, 1, 1),
        (105, 8, 8),
        (85, 8, 16),
        (85, 32, 32),
        (95, 8, 8),
    ],
)
def test_aimd_batch_within_bounds(value, batch, expected):
    policy = replace(POLICY, adaptive_batch=True, min_batch=1, max_batch=32)
    d = decide(Snapshot(value, 50), TierState(tiers=1, entered_s=0.0, batch=batch), policy, 100.0)
    assert d.state.batch == expected


@pytest.mark.parametrize(
    "metric, mode, adaptive",
    [
        ("ttft_ms", "auto", False),
        ("itl_ms", "auto", True),
        ("tpot_ms", "off", False),
        ("ttft_ms", "on", True),
    ],
)
def test_policy_from_the_sla_section(metric, mode, adaptive):
    from edge_agent.config import SlaConfig
    from edge_agent.serving.tiers.policy import policy_from_config

    sla = SlaConfig(metric=metric, adaptive_batch=mode, preset="customer-service", min_batch=8)
    policy = policy_from_config(sla, max_batch=4)
    assert policy.adaptive_batch is adaptive
    assert policy.target_ms == 220.0 and policy.metric == metric  # explicit metric wins over the preset's
    assert policy.min_batch == 4 and policy.max_batch == 4


def test_the_way_back_up_waits_until_the_load_is_below_what_broke_the_heavier_tier():
    policy = replace(POLICY, upgrade_after=2, cooldown_s=0.0, min_dwell_s=0.0)
    state = TierState(tiers=2, entered_s=0.0)
    for t in (1.0, 2.0, 3.0):  # breaks at 10 req/s
        d = decide(Snapshot(300, 50, rate_per_s=10.0), state, policy, t)
        state = d.state
    assert d.action == "downgrade" and state.tier == 1 and state.broke_at == ((0, 10.0, 3.0),)
    # the light tier is fast, but the load is still 9 req/s: 9 >= 0.7 × 10 -> stay
    for t in (4.0, 5.0, 6.0):
        d = decide(Snapshot(20, 50, rate_per_s=9.0), state, policy, t)
        state = d.state
    assert d.action == "hold" and state.tier == 1 and "at which tier 0 broke" in d.reason
    d = decide(Snapshot(20, 50, rate_per_s=6.0), state, policy, 7.0)
    assert d.action == "upgrade" and d.state.tier == 0
    # the memory fades: long after, a fast light tier goes back up whatever the rate
    late = decide(Snapshot(20, 50, rate_per_s=9.0), replace(state, under=5), policy, 3.0 + policy.forget_after_s)
    assert late.action == "upgrade"


# -- no samples: shedding ends, unpin goes home ------------------------------------------------------

SHED = replace(POLICY, min_token_cap_ratio=0.25, shed_after=2, cooldown_s=30.0)


def shedding_state(policy=SHED, start=100.0) -> tuple[TierState, float]:
    """At the lightest tier, over target until shedding; returns the state and when shedding began."""
    decisions = run([300] * 5, state=TierState(tiers=2, tier=1, entered_s=0.0), policy=policy, start=start)
    began = next(start + i * 5.0 for i, d in enumerate(decisions) if d.state.shedding)
    assert decisions[-1].state.shedding and decisions[-1].state.token_cap_ratio == 0.25
    return decisions[-1].state, began


@pytest.mark.parametrize(
    "count, after_s, action, shedding, cap",
    [
        (0, 29.0, "insufficient", True, 0.25),  # no samples, inside the cooldown: keep shedding
        (0, 30.0, "probe", False, 1.0),  # the cooldown since shedding began: lift it all
        (19, 31.0, "probe", False, 1.0),  # a trickle under min_samples is no evidence either
        (0, 3600.0, "probe", False, 1.0),
    ],
)
def test_shedding_without_samples_ends_after_the_cooldown(count, after_s, action, shedding, cap):
    state, began = shedding_state()
    d = decide(Snapshot(None if count == 0 else 300.0, count), state, SHED, began + after_s)
    assert (d.action, d.state.shedding, d.state.token_cap_ratio) == (action, shedding, cap), d.reason
    assert d.fresh_window == (action == "probe")
    if action == "probe":
        assert "cooldown 30 s" in d.reason


def test_truncation_alone_is_lifted_too_when_no_samples_come():
    state = run([300, 300], state=TierState(tiers=2, tier=1, entered_s=0.0), policy=SHED)[-1].state
    assert state.token_cap_ratio == 0.25 and not state.shedding  # truncated at t=105
    assert decide(Snapshot(None, 0), state, SHED, 134.0).action == "insufficient"
    d = decide(Snapshot(None, 0), state, SHED, 135.0)
    assert d.action == "probe" and d.state.token_cap_ratio == 1.0


def test_shedding_is_bounded_even_while_the_stale_window_stays_over_target():
    state, began = shedding_state()
    held = decide(Snapshot(300.0, 50), state, SHED, began + 25.0)
    assert held.action == "hold" and held.state.shedding
    probe = decide(Snapshot(300.0, 50), held.state, SHED, began + 30.0)
    assert probe.action == "probe" and not probe.state.shedding and probe.state.token_cap_ratio == 0.25
    # still over target on what the probe admitted: shedding again after shed_after evaluations
    again = run([300] * 3, state=probe.state, policy=SHED, start=began + 35.0)
    assert [d.state.shedding for d in again] == [False, True, True]
    resumed = began + 40.0  # the second of the evaluations at +35, +40, +45
    assert decide(Snapshot(300.0, 50), again[-1].state, SHED, resumed + 29.0).state.shedding
    assert decide(Snapshot(300.0, 50), again[-1].state, SHED, resumed + 30.0).action == "probe"


def test_a_sustained_overload_alternates_shedding_and_probes_with_a_fake_clock():
    state = TierState(tiers=1, entered_s=0.0)
    policy = replace(SHED, cooldown_s=20.0)
    timeline = []
    for i in range(40):  # one evaluation a second; the load never lets up
        d = decide(Snapshot(300.0, 50), state, policy, 100.0 + i)
        timeline.append(d.state.shedding)
        state = d.state
    assert 0.5 < sum(timeline) / len(timeline) < 1.0  # mostly shedding, never for good
    assert timeline[-25:].count(False) >= 1


def test_unpinned_with_no_samples_goes_back_to_the_top_tier():
    pinned = decide(Snapshot(None, 0), TierState(tiers=3, entered_s=0.0, pinned=2), POLICY, 100.0)
    assert pinned.action == "pin" and pinned.state.tier == 2  # a pin needs no samples
    idle = run([None] * 5, state=pinned.state, start=105.0, count=0)
    assert {d.action for d in idle} == {"insufficient"} and set(tiers(idle)) == {2}
    d = decide(Snapshot(None, 0), replace(idle[-1].state, pinned=None, released=True), POLICY, 200.0)
    assert d.action == "unpin" and d.switched and d.state.tier == 0 and not d.state.released
    assert "back to the top tier" in d.reason
    later = decide(Snapshot(None, 0), d.state, POLICY, 210.0)
    assert later.action == "insufficient" and later.state.tier == 0


def test_unpinned_with_samples_leaves_it_to_the_usual_rules():
    state = TierState(tiers=3, tier=2, entered_s=190.0, pinned=None, released=True)
    d = decide(Snapshot(150.0, 50), state, POLICY, 200.0)  # over target on the light tier: no jump up
    assert d.action == "hold" and d.state.tier == 2 and not d.state.released
    d = decide(Snapshot(None, 0), replace(state, tier=0), POLICY, 200.0)
    assert d.action == "insufficient" and d.state.tier == 0 and not d.state.released


def test_an_idle_device_without_relief_or_release_holds():
    state = TierState(tiers=3, tier=1, entered_s=0.0)
    assert decide(Snapshot(None, 0), state, POLICY, 10_000.0) == Decision(
        state, "insufficient", "0 ttft_ms samples in the window, fewer than min_samples 20"
    )


# -- pressure: arrivals predicted over their budget ---------------------------------------------------


def test_the_first_arrival_predicted_over_budget_moves_one_tier_lighter_at_once():
    policy = replace(POLICY, min_dwell_s=10.0)
    state = TierState(tiers=3, entered_s=0.0)
    quiet = decide(Snapshot(None, 0, rate_per_s=2.0, arrivals=4), state, policy, 20.0)
    assert quiet.action != "downgrade"  # arrivals that fit move nothing
    d = decide(Snapshot(None, 0, rate_per_s=2.0, over_budget=1, arrivals=5), state, policy, 20.0)
    assert d.action == "downgrade" and d.state.tier == 1 and "1 of 5 arrivals" in d.reason
    # the dwell time still holds: a tier entered 5 s ago stays
    held = decide(Snapshot(None, 0, over_budget=1, arrivals=5), TierState(tiers=3, entered_s=15.0), policy, 20.0)
    assert held.action != "downgrade"
    # a policy that asks for two waits for the second
    two = replace(policy, pressure_min=2)
    assert decide(Snapshot(None, 0, over_budget=1, arrivals=5), state, two, 20.0).action != "downgrade"
    assert decide(Snapshot(None, 0, over_budget=2, arrivals=6), state, two, 20.0).action == "downgrade"


def test_a_move_for_pressure_remembers_the_throughput_at_which_the_tier_broke():
    """The way back up after a move for pressure waits, as after one for samples, until the load is below
    ``upgrade_ratio`` of what the heavier tier completed when it broke."""
    policy = replace(POLICY, upgrade_after=2, cooldown_s=0.0, min_dwell_s=0.0)
    loaded = Snapshot(80, policy.min_samples, rate_per_s=10.0, over_budget=1, arrivals=3)
    d = decide(loaded, TierState(tiers=2, entered_s=0.0), policy, 3.0)
    assert d.action == "downgrade" and d.state.broke_at == ((0, 10.0, 3.0),)
    state = d.state
    for t in (4.0, 5.0, 6.0):
        d = decide(Snapshot(20, 50, rate_per_s=9.0), state, policy, t)
        state = d.state
    assert d.action == "hold" and state.tier == 1 and "at which tier 0 broke" in d.reason
    assert decide(Snapshot(20, 50, rate_per_s=6.0), state, policy, 7.0).action == "upgrade"


def test_a_lone_arrival_over_budget_at_a_light_load_moves_down_and_back_up_as_usual():
    """Too few samples to measure a throughput: the move remembers none, and the way back up does not wait
    for a load below a rate the tier never broke at."""
    policy = replace(POLICY, upgrade_after=2, cooldown_s=0.0, min_dwell_s=0.0)
    light = Snapshot(None, policy.min_samples - 1, rate_per_s=0.2, over_budget=1, arrivals=2)
    d = decide(light, TierState(tiers=2, entered_s=0.0), policy, 3.0)
    assert d.action == "downgrade" and d.state.broke_at == ()
    state = d.state
    for t in (4.0, 5.0):
        d = decide(Snapshot(20, 50, rate_per_s=0.4), state, policy, t)
        state = d.state
    assert d.action == "upgrade" and state.tier == 0
