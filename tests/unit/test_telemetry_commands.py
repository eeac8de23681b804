from __future__ import annotations

import json

import pytest

from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.commands import CommandProcessor
from edge_agent.telemetry.ledger import Ledger
from tests.telemetry_target import TinyAgent

PREFIX = "edge/v1/dev-1"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rig(tmp_path):
    agent = TinyAgent()
    sent: list[tuple[str, dict, bytes | None]] = []
    reported: list[dict] = []
    clock, wall = Clock(), Clock(1.7e9)
    proc = CommandProcessor(agent, Ledger(tmp_path / "ledger.sqlite"), PREFIX, "dev-1",
                            lambda topic, body, corr: sent.append((topic, json.loads(body), corr)),
                            reported.append, max_bytes=1024, clock=clock, wall=wall)
    return proc, agent, sent, reported, clock, wall


def msg(name: str, body, *, response_topic="fleet/res/1", corr=b"c-1", expiry=None) -> Incoming:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Incoming(f"{PREFIX}/cmd/{name}/req", payload, response_topic, corr, expiry, False)


def statuses(sent):
    return [m["status"] for _t, m, _c in sent]


def test_lifecycle_on_response_topic_with_correlation_data(rig):
    proc, agent, sent, reported, *_ = rig
    proc.handle(msg("pin_tier", {"cmd_id": "a1", "args": {"workload": "llm", "tier": "tiny"}}))
    assert statuses(sent) == ["accepted", "executing", "succeeded"]
    assert all(t == "fleet/res/1" and c == b"c-1" for t, _m, c in sent)
    assert sent[-1][1]["result"] == {"workload": "llm", "tier": "tiny"}
    assert agent.pins == {"llm": "tiny"}
    assert reported[-1]["pins"] == {"llm": "tiny"}


def test_default_response_topic_without_mqtt5_properties(rig):
    proc, _agent, sent, *_ = rig
    proc.handle(msg("get_status", {"cmd_id": "s1"}, response_topic=None, corr=None))
    assert {t for t, _m, _c in sent} == {f"{PREFIX}/cmd/get_status/res"}
    assert sent[-1][1]["result"]["active_tiers"]["llm"] == "small"


def test_duplicate_runs_once_even_after_restart(rig, tmp_path):
    proc, agent, sent, *_ = rig
    request = {"cmd_id": "r1", "args": {"recipe": "phi3-int8"}}
    proc.handle(msg("rebuild_engine", request))
    proc.handle(msg("rebuild_engine", request))
    assert [c for c in agent.calls if c[0] == "rebuild_engine"] == [("rebuild_engine", "phi3-int8")]
    dup = sent[-1][1]
    assert dup["duplicate"] is True and dup["status"] == "succeeded" and dup["result"]["engine_hash"] == "sha256:abc"
    proc.ledger.close()
    again = CommandProcessor(agent, Ledger(tmp_path / "ledger.sqlite"), PREFIX, "dev-1",
                             lambda t, b, c: sent.append((t, json.loads(b), c)))
    again.handle(msg("rebuild_engine", request))
    assert len([c for c in agent.calls if c[0] == "rebuild_engine"]) == 1
    assert sent[-1][1]["duplicate"] is True


def test_interrupted_command_is_reported_not_rerun(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.record("x1", "rebuild_engine", "executing", None)
    ledger.close()
    agent, sent = TinyAgent(), []
    proc = CommandProcessor(agent, Ledger(tmp_path / "l.sqlite"), PREFIX, "dev-1",
                            lambda t, b, c: sent.append(json.loads(b)))
    proc.handle(msg("rebuild_engine", {"cmd_id": "x1", "args": {"recipe": "phi3-int8"}}))
    assert agent.calls == []
    assert sent[-1]["status"] == "failed" and "interrupted" in sent[-1]["reason"] and sent[-1]["duplicate"]


@pytest.mark.parametrize("name, body, reason", [
    ("format_disk", {"cmd_id": "u1"}, "unknown command 'format_disk'"),
    ("pin_tier", {"cmd_id": "u2", "args": {"workload": "llm", "tier": "huge"}}, "tier 'huge' is not configured"),
    ("pin_tier", {"cmd_id": "u3", "args": {"workload": "video", "tier": "small"}}, "unknown workload 'video'"),
    ("pin_tier", {"cmd_id": "u4", "args": {"workload": "llm"}}, "args... tier"),
    ("rebuild_engine", {"cmd_id": "u5", "args": {"recipe": "/etc/passwd"}}, "recipe"),
    ("rebuild_engine", {"cmd_id": "u6", "args": {"recipe": "other"}}, "recipe 'other' is not configured"),
    ("set_sla", {"cmd_id": "u7", "args": {"workload": "llm", "sla": {"target_ms": -5}}}, "target_ms"),
    ("get_status", {"cmd_id": "u8", "args": {"verbose": True}}, "verbose"),
    ("get_status", b"{not json", "malformed request"),
    ("get_status", {"args": {}}, "cmd_id"),
    ("get_status", {"cmd_id": "u9", "extra": 1}, "extra"),
    ("get_status", json.dumps({"cmd_id": "big", "args": {}, "pad": "x" * 2000}).encode(), "over the 1024-byte limit"),
])
def test_bad_requests_are_rejected_with_the_reason(rig, name, body, reason):
    proc, agent, sent, *_ = rig
    proc.handle(msg(name, body))
    assert statuses(sent) == ["rejected"]
    got = sent[-1][1]["reason"]
    for part in reason.split("..."):
        assert part.strip() in got, got
    assert agent.calls == []


def test_rejection_is_not_recorded_so_a_corrected_retry_runs(rig):
    proc, agent, sent, *_ = rig
    proc.handle(msg("pin_tier", {"cmd_id": "k1", "args": {"workload": "llm", "tier": "nope"}}))
    proc.handle(msg("pin_tier", {"cmd_id": "k1", "args": {"workload": "llm", "tier": "tiny"}}))
    assert statuses(sent) == ["rejected", "accepted", "executing", "succeeded"]


def test_expired_by_message_expiry_or_deadline(rig):
    proc, agent, sent, _rep, clock, wall = rig
    proc.handle(msg("flush_telemetry", {"cmd_id": "e1"}, expiry=5), received_mono=clock.t - 6)
    proc.handle(msg("flush_telemetry", {"cmd_id": "e2", "expires_at_wall": wall.t - 1}))
    assert statuses(sent) == ["expired", "expired"] and agent.flushes == 0
    proc.handle(msg("flush_telemetry", {"cmd_id": "e3"}, expiry=5), received_mono=clock.t - 1)
    assert statuses(sent)[-1] == "succeeded" and agent.flushes == 1


def test_failure_of_the_target_is_reported(rig):
    proc, agent, sent, *_ = rig
    agent.fail_rebuild = "calibration data missing for phi3-int8"
    proc.handle(msg("rebuild_engine", {"cmd_id": "f1", "args": {"recipe": "phi3-int8"}}))
    assert statuses(sent) == ["accepted", "executing", "failed"]
    assert sent[-1][1]["reason"] == "calibration data missing for phi3-int8"


def test_desired_applies_newer_versions_all_or_nothing(rig):
    proc, agent, _sent, reported, *_ = rig
    doc = {"version": 3, "sla": {"llm": {"target_ms": 220}}, "pins": {"llm": "tiny"}}
    assert proc.apply_desired(json.dumps(doc).encode())
    assert agent.pins == {"llm": "tiny"} and agent.sla["llm"].target_ms == 220
    assert reported[-1]["desired_version"] == 3 and reported[-1]["pins"] == {"llm": "tiny"}
    assert not proc.apply_desired(json.dumps({**doc, "version": 2, "pins": {"llm": None}}).encode())
    assert agent.pins == {"llm": "tiny"}
    bad = {"version": 4, "sla": {"llm": {"target_ms": 100}}, "pins": {"llm": "huge"}}
    assert not proc.apply_desired(json.dumps(bad).encode())
    assert agent.sla["llm"].target_ms == 220  # nothing of the bad version was applied
    assert "huge" in reported[-1]["desired_error"] and reported[-1]["desired_version"] == 3
    assert not proc.apply_desired(b"{oops")
    assert "desired not applied" in reported[-1]["desired_error"]
    assert proc.apply_desired(json.dumps({"version": 5, "pins": {"llm": None}}).encode())
    assert agent.pins == {} and reported[-1]["desired_error"] is None
