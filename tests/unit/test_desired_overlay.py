"""The fleet's ``desired`` overlays the config file and survives restarts and reloads: the ledger keeps
the applied document, ``restore_desired`` puts it back before serving, the broker's retained copy of
the same version is a no-op, ``reset_desired`` forgets it, and ``reported`` says where each value
comes from."""

from __future__ import annotations

import json

from edge_agent.errors import EdgeAgentError
from edge_agent.telemetry.desired import DESIRED_KEY
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import CommandProcessor
from edge_agent.telemetry.schema import Reported
from tests.telemetry_target import TinyAgent

PREFIX = "edge/v1/dev-1"
V7 = json.dumps({"version": 7, "sla": {"llm": {"target_ms": 220}}, "pins": {"llm": "tiny"}}).encode()


def processor(tmp_path, agent=None):
    agent = agent or TinyAgent()
    reported: list[dict] = []
    proc = CommandProcessor(
        agent, Ledger(tmp_path / "ledger.sqlite"), PREFIX, "dev-1", lambda topic, body, corr: None, reported.append
    )
    return proc, agent, reported


def restart(tmp_path, proc):
    proc.ledger.close()
    return processor(tmp_path)


def test_after_a_restart_the_stored_desired_is_back_in_force_and_the_retained_copy_is_a_no_op(tmp_path):
    proc, agent, reported = processor(tmp_path)
    assert proc.apply_desired(V7)
    assert reported[-1]["desired_version"] == 7
    assert reported[-1]["sources"] == {"sla.llm": "desired@7", "pins.llm": "desired@7"}

    proc, agent, reported = restart(tmp_path, proc)  # a fresh agent runs the file's SLA, no pins
    assert not proc.apply_desired(V7)  # the broker's retained copy arrives while the models load
    assert agent.calls == [] and reported[-1]["desired_version"] is None  # not claimed before it is in force
    assert proc.restore_desired()
    assert agent.sla["llm"].target_ms == 220 and agent.pins == {"llm": "tiny"}
    assert reported[-1]["desired_version"] == 7 and reported[-1]["desired_error"] is None
    assert reported[-1]["sources"]["sla.llm"] == "desired@7"
    calls = list(agent.calls)
    assert not proc.apply_desired(V7)  # re-delivered on a reconnect: idempotent
    assert agent.calls == calls and reported[-1]["desired_version"] == 7
    Reported(device_id="dev-1", **reported[-1])  # the wire model accepts it, sources included


def test_a_newer_desired_that_arrives_before_the_agent_serves_applies_at_start(tmp_path):
    class Loading(TinyAgent):
        serving = False

        def set_sla(self, workload, sla, source="command"):
            if not self.serving:
                raise EdgeAgentError(f"no SLA controller for workload {workload!r} on this device")
            return super().set_sla(workload, sla, source)

    agent = Loading()
    proc, _agent, reported = processor(tmp_path, agent)
    assert not proc.apply_desired(V7)
    assert "failed" in reported[-1]["desired_error"] and reported[-1]["desired_version"] is None
    agent.serving = True
    assert proc.restore_desired()
    assert agent.sla["llm"].target_ms == 220 and reported[-1]["desired_version"] == 7
    assert reported[-1]["desired_error"] is None and proc.ledger.get(DESIRED_KEY) == "7"


def test_reapply_after_a_reload_puts_the_desired_back_on_top_of_the_file(tmp_path):
    proc, agent, reported = processor(tmp_path)
    proc.apply_desired(V7)
    agent.reload()  # the file: no SLA override, desired pins dropped
    assert agent.sla == {} and agent.pins == {}
    assert proc.reapply_desired()
    assert agent.sla["llm"].target_ms == 220 and agent.pins == {"llm": "tiny"}
    assert proc.reported()["sources"] == {"sla.llm": "desired@7", "pins.llm": "desired@7"}


def test_reset_desired_forgets_it_so_that_any_version_applies_and_goes_back_to_the_file(tmp_path):
    proc, agent, reported = processor(tmp_path)
    proc.apply_desired(V7)
    assert not proc.apply_desired(json.dumps({"version": 3, "sla": {"llm": {"target_ms": 333}}}).encode())
    result = proc.reset_desired()
    assert result["forgotten_version"] == 7 and agent.reloads == 1
    assert agent.sla == {} and agent.pins == {}
    assert reported[-1]["desired_version"] is None and reported[-1]["sources"]["sla.llm"] == "file"
    assert proc.ledger.get(DESIRED_KEY) is None
    assert proc.apply_desired(json.dumps({"version": 3, "sla": {"llm": {"target_ms": 333}}}).encode())
    assert agent.sla["llm"].target_ms == 333 and reported[-1]["desired_version"] == 3
    proc, agent, reported = restart(tmp_path, proc)  # what the restart restores is the new one
    assert proc.restore_desired() and agent.sla["llm"].target_ms == 333


def test_a_ledger_with_a_version_but_no_document_takes_the_retained_copy_again(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.put(DESIRED_KEY, "7")  # written by a version that kept only the number
    ledger.close()
    proc, agent, reported = processor(tmp_path)
    assert not proc.restore_desired() and reported[-1]["desired_version"] is None
    assert proc.apply_desired(V7)
    assert agent.sla["llm"].target_ms == 220 and reported[-1]["desired_version"] == 7


def test_an_older_version_is_still_ignored(tmp_path):
    proc, agent, reported = processor(tmp_path)
    proc.apply_desired(V7)
    calls = list(agent.calls)
    assert not proc.apply_desired(json.dumps({"version": 6, "pins": {"llm": None}}).encode())
    assert agent.calls == calls and agent.pins == {"llm": "tiny"} and reported[-1]["desired_version"] == 7
