"""The ladder base: a start serves the top tier, or else the first lighter one that loads (the same
code for the LLM and the ASR ladders), and one policy builder for both workloads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edge_agent.config import AsrSlaConfig, SlaConfig
from edge_agent.errors import EdgeAgentError, ModelError, none_loaded
from edge_agent.serving.tiers.ladder import Ladder
from edge_agent.serving.tiers.policy import policy_from_config


class Fake(Ladder):
    def __init__(self, broken: set[str]) -> None:
        super().__init__([SimpleNamespace(name=n) for n in ("heavy", "middle", "light")])
        self.broken, self.opened = broken, []

    def _load(self, index: int):
        name = self.tiers[index].name
        self.opened.append(name)
        if name in self.broken:
            raise ModelError(f"{name} is broken")
        return SimpleNamespace(index=index, tier=self.tiers[index])

    def _retire(self, old) -> None:
        pass


def test_the_top_tier_serves_when_it_loads():
    ladder = Fake(set())
    assert ladder.start_first() == [] and ladder.active_tier == "heavy" and ladder.opened == ["heavy"]


def test_tiers_that_fail_are_reported_and_the_next_lighter_one_serves():
    failed: list[tuple[str, str]] = []
    ladder = Fake({"heavy", "middle"})
    errors = ladder.start_first(lambda tier, exc: failed.append((tier, str(exc))))
    assert ladder.active_tier == "light" and ladder.active == 2
    assert errors == [("heavy", "heavy is broken"), ("middle", "middle is broken")]
    assert failed == [("heavy", "heavy is broken"), ("middle", "middle is broken")]


def test_nothing_serves_when_no_tier_loads():
    ladder = Fake({"heavy", "middle", "light"})
    assert len(ladder.start_first()) == 3 and ladder.active_tier is None


def test_tiers_that_failed_the_same_way_are_named_together_in_one_line():
    errors = [("full", "model 'm' is not here yet"), ("short", "model 'm' is not here yet"), ("npu", "no NPU")]
    assert str(none_loaded("LLM", errors)) == (
        "no LLM tier could be loaded: full, short: model 'm' is not here yet; npu: no NPU"
    )


def test_an_unexpected_error_is_not_taken_for_a_tier_that_cannot_load():
    class Crashing(Fake):
        def _load(self, index: int):
            raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        Crashing(set()).start_first()


def test_one_policy_builder_for_both_workloads():
    llm = policy_from_config(SlaConfig(metric="itl_ms", min_batch=8), max_batch=4)
    assert llm.adaptive_batch and (llm.min_batch, llm.max_batch) == (4, 4) and llm.min_token_cap_ratio == 0.25
    asr = policy_from_config(AsrSlaConfig(target_ms=250))
    assert (asr.metric, asr.target_ms, asr.adaptive_batch) == ("first_partial_ms", 250, False)
    assert asr.min_token_cap_ratio == 1.0
    with pytest.raises(ValueError, match="max_batch"):
        policy_from_config(SlaConfig())
    assert issubclass(ModelError, EdgeAgentError)
