"""The tier controller on the ASR workload: utterance samples in, switches and shedding out.

A fake clock and a ladder that records what it is told; no threads, no sleeps, no engines."""

from __future__ import annotations

import pytest

from edge_agent.config import AsrSlaConfig
from edge_agent.observe import Observation
from edge_agent.serving.asr.tiers import SpeechTier
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import policy_from_config


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Ladder:
    """The surface the controller drives. Slotted: the controller setting anything else (a token cap,
    a batch size) fails the test."""

    __slots__ = ("tiers", "active", "switching", "shedding", "switches")

    def __init__(self, active: int = 0) -> None:
        self.tiers = [SpeechTier("heavy", lambda: None), SpeechTier("light", lambda: None)]
        self.active, self.switching, self.shedding = active, False, False
        self.switches: list[int] = []

    def switch_to(self, index: int) -> bool:
        self.switches.append(index)
        self.active = index  # as if loaded at once
        return True

    def relieve(self, shedding: bool, token_cap_ratio: float | None = None) -> None:
        assert token_cap_ratio is None, "an ASR policy never caps tokens"
        self.shedding = shedding


POLICY = policy_from_config(
    AsrSlaConfig(
        target_ms=300, min_samples=3, downgrade_after=2, upgrade_after=2, cooldown_s=10, min_dwell_s=0, shed_after=2
    )
)


def build(active: int = 0, window_s: float = 30.0):
    clock, ladder, events = Clock(), Ladder(active), []
    controller = TierController(
        ladder,
        POLICY,
        window_s=window_s,
        clock=clock,
        workload="asr",
        on_event=lambda kind, payload: events.append((kind, payload)),
    )
    return clock, ladder, controller, events


def utterances(controller, tier: str, first_partial_ms: float, n: int = 5) -> None:
    for _ in range(n):
        controller.observe(
            Observation("asr", tier, "m", {"first_partial_ms": (first_partial_ms,), "final_ms": (40.0,), "rtf": (0.1,)})
        )


def test_policy_from_sla_asr_has_no_token_cap_and_no_adaptive_batch():
    p = policy_from_config(AsrSlaConfig(preset="asr-customer-service", downgrade_after=5))
    assert (p.metric, p.percentile, p.target_ms, p.downgrade_after) == ("first_partial_ms", 95, 300.0, 5)
    assert p.min_token_cap_ratio == 1.0 and not p.adaptive_batch


def test_slow_first_partials_switch_down_with_the_snapshot_in_the_event():
    clock, ladder, controller, events = build()
    utterances(controller, "heavy", 450.0)
    clock.now = 1.0
    assert controller.evaluate().action == "hold"  # one slow evaluation is not a trend
    clock.now = 2.0
    decision = controller.evaluate()
    assert decision.action == "downgrade" and ladder.switches == [1]
    ((kind, payload),) = events
    assert kind == "tier_switch" and payload["workload"] == "asr"
    assert (payload["from"], payload["to"], payload["action"]) == ("heavy", "light", "downgrade")
    snap = payload["snapshot"]
    assert (snap["metric"], snap["value_ms"], snap["count"], snap["target_ms"]) == ("first_partial_ms", 450.0, 5, 300)
    assert snap["rate_per_s"] == pytest.approx(2.5)  # 5 utterances over the 2 s the window has existed


def test_only_the_active_tiers_utterances_and_the_policy_metric_count():
    clock, ladder, controller, events = build()
    utterances(controller, "light", 900.0)  # a stream draining on another tier says nothing about this one
    for _ in range(5):  # too short for a partial: counted as load, not as a first_partial sample
        controller.observe(Observation("asr", "heavy", "m", {"final_ms": (900.0,), "rtf": (0.1,)}))
    clock.now = 1.0
    decision = controller.evaluate()
    assert decision.action == "insufficient" and "0 first_partial_ms samples" in decision.reason
    assert controller.window.count("requests", clock.now) == 5
    assert ladder.switches == [] and events == []


def test_upgrade_needs_the_hysteresis_band_and_the_cooldown():
    clock, ladder, controller, events = build()
    utterances(controller, "heavy", 450.0)
    clock.now = 1.0
    controller.evaluate()
    clock.now = 2.0
    assert controller.evaluate().action == "downgrade"
    # Light tier at 250 ms: under target, but not under 0.7 × 300 = 210 ms: stay.
    clock.now = 3.0
    utterances(controller, "light", 250.0)
    for t in (4.0, 5.0, 6.0, 20.0):
        clock.now = t
        assert controller.evaluate().action == "hold"
    assert ladder.switches == [1] and not ladder.shedding and controller.state.under == 0
    # The 250 ms samples leave the 30 s window; 100 ms ones arrive at a low load.
    clock.now = 40.0
    utterances(controller, "light", 100.0)
    clock.now = 41.0
    assert controller.evaluate().action == "hold"  # one evaluation under the band
    clock.now = 42.0
    decision = controller.evaluate()
    assert decision.action == "upgrade", decision.reason
    assert ladder.switches == [1, 0] and events[-1][1]["to"] == "heavy"


def test_no_upgrade_before_the_cooldown():
    clock, ladder, controller, _ = build(window_s=100.0)
    utterances(controller, "heavy", 450.0)
    clock.now = 1.0
    controller.evaluate()
    clock.now = 2.0
    assert controller.evaluate().action == "downgrade"
    utterances(controller, "light", 100.0)
    clock.now = 3.0
    controller.evaluate()
    clock.now = 4.0  # two evaluations under the band, but only 2 s of the 10 s cooldown
    assert controller.evaluate().action == "hold" and ladder.switches == [1]
    clock.now = 12.0
    assert controller.evaluate().action == "upgrade"


def test_a_pin_overrides_the_controller_until_unpinned():
    clock, ladder, controller, events = build()
    controller.pin("light")  # applied at once, with no samples at all
    assert ladder.switches == [1] and events[-1][1]["action"] == "pin"
    utterances(controller, "light", 50.0)
    for t in (1.0, 2.0, 3.0, 15.0):
        clock.now = t
        assert controller.evaluate().action == "hold"
    assert ladder.switches == [1]
    with pytest.raises(ValueError, match="asr tiers"):
        controller.pin("medium")
    controller.unpin()
    clock.now = 16.0
    assert controller.evaluate().action == "upgrade" and ladder.switches == [1, 0]


def test_over_target_at_the_lightest_tier_sheds_and_recovers_without_token_caps():
    clock, ladder, controller, _ = build(active=1)
    utterances(controller, "light", 500.0)
    clock.now = 1.0
    controller.evaluate()
    assert not ladder.shedding  # the first evaluation at the floor only counts
    clock.now = 2.0
    controller.evaluate()
    assert ladder.shedding and ladder.switches == []
    clock.now = 40.0  # the slow samples have left the window
    utterances(controller, "light", 100.0)
    controller.evaluate()
    assert not ladder.shedding


def test_a_tier_that_fails_to_load_leaves_the_controller_on_the_old_one():
    clock, ladder, controller, events = build()
    utterances(controller, "heavy", 450.0)
    clock.now, _ = 1.0, controller.evaluate()
    clock.now, _ = 2.0, controller.evaluate()
    ladder.active = 0  # what the speech ladder does when the load fails
    controller.switch_failed(0, 1, "light: model.onnx is truncated")
    assert controller.state.tier == 0
    kind, payload = events[-1]
    assert kind == "tier_switch_failed" and payload == {
        "workload": "asr",
        "from": "heavy",
        "to": "light",
        "error": "light: model.onnx is truncated",
    }
    utterances(controller, "heavy", 450.0)  # heavy's utterances count again
    clock.now = 3.0
    assert controller.evaluate().state.over == 1
