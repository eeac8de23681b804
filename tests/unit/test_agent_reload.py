"""``Agent.reload`` (SIGHUP) with the fleet's ``desired`` on top of the file: the desired stays in
force, ``reported`` is republished with each value's source, a reload that changes nothing in force
leaves the controller alone, and ``reset_desired`` goes back to the file. A real Agent, controller,
command processor and ledger; a recording ladder instead of engines, a fake clock."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from edge_agent.config import load_settings
from edge_agent.daemon.app import Agent
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import policy_from_config
from edge_agent.systemd import Notifier
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import CommandProcessor
from edge_agent.telemetry.schema import Reported, SlaSpec

CONFIG = """
[models]
asr = []
[[models.llm]]
name = "top"
model = "demo-phi3"
[[models.llm]]
name = "light"
model = "demo-phi3"

[sla]
target_ms = {target}
window_s = 10
evaluate_every_s = 1
"""


class Ladder:
    def __init__(self) -> None:
        self.tiers = [SimpleNamespace(name="top"), SimpleNamespace(name="light")]
        self.active, self.switching, self.shedding, self.token_cap_ratio = 0, False, False, 1.0
        self.switches: list[int] = []

    def switch_to(self, index: int) -> bool:
        self.switches.append(index)
        self.active = index
        return True

    def relieve(self, shedding: bool, token_cap_ratio: float | None = None) -> None:
        self.shedding = shedding
        if token_cap_ratio is not None:
            self.token_cap_ratio = token_cap_ratio


@pytest.fixture
def rig(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(CONFIG.format(target=387))
    settings = load_settings(str(path))
    agent = Agent(settings, str(path), notifier=Notifier({}))
    clock = SimpleNamespace(now=0.0)
    ladder = Ladder()
    agent.controller = TierController(ladder, policy_from_config(settings.sla, 4), window_s=10, clock=lambda: clock.now)
    reported: list[dict] = []
    commands = CommandProcessor(
        agent.remote, Ledger(tmp_path / "ledger.sqlite"), "edge/v1/dev-1", "dev-1", lambda *_: None, reported.append
    )
    agent.telemetry = SimpleNamespace(commands=commands)
    yield agent, path, commands, ladder, reported
    commands.ledger.close()


def desired(version: int, **doc) -> bytes:
    return json.dumps({"version": version, **doc}).encode()


def test_a_reload_keeps_the_desired_on_top_of_the_file_and_republishes_reported(rig):
    agent, path, commands, ladder, reported = rig
    assert commands.apply_desired(desired(7, sla={"llm": {"target_ms": 222, "window_s": 5}}))
    assert agent.controller.policy.target_ms == 222 and agent.controller.window_s == 5

    path.write_text(CONFIG.format(target=500))  # the file changes too
    before = len(reported)
    assert "desired version 7 on top" in agent.reload()
    assert agent.controller.policy.target_ms == 222 and agent.controller.window_s == 5
    assert len(reported) > before
    doc = reported[-1]
    assert doc["sla"]["llm"]["target_ms"] == 222 and doc["desired_version"] == 7
    assert doc["sources"] == {"sla.llm": "desired@7", "pins.llm": "file"}
    Reported(device_id="dev-1", **doc)

    agent.remote.set_sla("llm", SlaSpec(target_ms=300))  # a command: in force until the next reload
    assert agent.remote.reported()["sources"]["sla.llm"] == "command" and agent.controller.policy.target_ms == 300
    agent.reload()
    assert agent.controller.policy.target_ms == 222 and reported[-1]["sources"]["sla.llm"] == "desired@7"


def test_a_reload_that_changes_nothing_in_force_leaves_shedding_and_the_window_alone(rig):
    agent, _path, commands, ladder, _reported = rig
    commands.apply_desired(desired(7, sla={"llm": {"target_ms": 222, "window_s": 5}}))
    controller = agent.controller
    controller.state = replace(controller.state, shedding=True, token_cap_ratio=0.25, over_at_floor=3)
    ladder.shedding, window = True, controller.window
    agent.reload()
    assert controller.state.shedding and controller.state.token_cap_ratio == 0.25 and ladder.shedding
    assert controller.window is window
    agent.remote.set_sla("llm", SlaSpec(target_ms=10_000, window_s=5))  # a new target: relief lifted at once
    assert not controller.state.shedding and not ladder.shedding and controller.state.token_cap_ratio == 1.0


def test_reset_desired_goes_back_to_the_file_and_drops_the_desired_pin(rig):
    agent, _path, commands, ladder, reported = rig
    assert commands.apply_desired(desired(8, sla={"llm": {"target_ms": 222}}, pins={"llm": "light"}))
    assert ladder.active == 1 and agent.remote.reported()["sources"]["pins.llm"] == "desired@8"
    result = commands.reset_desired()
    assert result["forgotten_version"] == 8
    assert agent.controller.policy.target_ms == 387 and agent.controller.state.pinned is None
    doc = reported[-1]
    assert doc["desired_version"] is None and doc["pins"] == {}
    assert doc["sources"] == {"sla.llm": "file", "pins.llm": "file"}
    agent.controller.evaluate()  # idle: the unpinned ladder goes back to the top tier
    assert ladder.switches[-1] == 0 and agent.controller.last.action == "unpin"
    assert commands.apply_desired(desired(2, sla={"llm": {"target_ms": 333}}))  # any version applies now
    assert agent.controller.policy.target_ms == 333
