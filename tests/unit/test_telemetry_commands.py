from __future__ import annotations

import json

import pytest

from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import MAX_QUEUE as MAX
from edge_agent.telemetry.remote_commands import CommandProcessor
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
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "ledger.sqlite"),
        PREFIX,
        "dev-1",
        lambda topic, body, corr: sent.append((topic, json.loads(body), corr)),
        reported.append,
        max_bytes=1024,
        clock=clock,
        wall=wall,
        reply_prefixes=("fleet/res/",),
    )
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
    again = CommandProcessor(
        agent,
        Ledger(tmp_path / "ledger.sqlite"),
        PREFIX,
        "dev-1",
        lambda t, b, c: sent.append((t, json.loads(b), c)),
        reply_prefixes=("fleet/res/",),
    )
    again.handle(msg("rebuild_engine", request))
    assert len([c for c in agent.calls if c[0] == "rebuild_engine"]) == 1
    assert sent[-1][1]["duplicate"] is True


def test_interrupted_command_is_reported_not_rerun(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.record("x1", "rebuild_engine", "executing", None)
    ledger.close()
    agent, sent = TinyAgent(), []
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev-1",
        lambda t, b, c: sent.append(json.loads(b)),
        reply_prefixes=("fleet/res/",),
    )
    proc.handle(msg("rebuild_engine", {"cmd_id": "x1", "args": {"recipe": "phi3-int8"}}))
    assert agent.calls == []
    assert sent[-1]["status"] == "failed" and "interrupted" in sent[-1]["reason"] and sent[-1]["duplicate"]


@pytest.mark.parametrize(
    "name, body, reason",
    [
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
        (
            "get_status",
            json.dumps({"cmd_id": "big", "args": {}, "pad": "x" * 2000}).encode(),
            "over the 1024-byte limit",
        ),
    ],
)
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


# -- trust: reply topics, the command allow-list, signatures, floods ----------------------------------


@pytest.mark.parametrize(
    "topic, allowed",
    [
        ("edge/v1/OTHER/state", False),
        ("edge/v1/dev-1/state", False),  # its own retained state: not a reply topic
        ("edge/v1/dev-1/cmd/pin_tier/req", False),  # would come back to it as a command
        ("edge/v1/dev-1/tele/latency", False),
        ("edge/v1/dev-10/cmd/get_status/res", False),  # a prefix of the name is not the device
        ("fleet/resX/1", False),
        ("fleet/res/+", False),
        ("edge/v1/dev-1/cmd/get_status/res", True),
        ("edge/v1/dev-1/cmd/get_status/res/fleet-7", True),
        ("edge/v1/dev-1/res/42", True),
        ("fleet/res/1", True),
    ],
)
def test_reply_topic_allow_list(rig, topic, allowed):
    proc, agent, sent, *_ = rig
    proc.handle(msg("get_status", {"cmd_id": "t1"}, response_topic=topic, corr=b"k"))
    if allowed:
        assert statuses(sent) == ["accepted", "executing", "succeeded"] and {t for t, _m, _c in sent} == {topic}
    else:
        assert statuses(sent) == ["rejected"], sent
        t, body, corr = sent[0]
        assert t == f"{PREFIX}/cmd/get_status/res" and corr == b"k" and body["cmd_id"] == "t1"
        assert "response topic" in body["reason"] and topic in body["reason"]
        assert agent.calls == [] and proc.ledger.lookup("t1") is None  # not run; the id stays usable


def test_command_outside_commands_allowed_is_rejected(tmp_path):
    agent, sent = TinyAgent(), []
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev-1",
        lambda t, b, c: sent.append(json.loads(b)),
        allowed=["get_status"],
    )
    proc.handle(msg("pin_tier", {"cmd_id": "p1", "args": {"workload": "llm", "tier": "tiny"}}, response_topic=None))
    assert [m["status"] for m in sent] == ["rejected"] and "commands_allowed" in sent[0]["reason"]
    assert agent.pins == {}
    proc.handle(msg("get_status", {"cmd_id": "g1"}, response_topic=None))
    assert sent[-1]["status"] == "succeeded"


def test_every_known_command_is_configurable():
    from edge_agent.config import FLEET_COMMANDS
    from edge_agent.telemetry.command_args import ALLOWED

    assert set(ALLOWED) == set(FLEET_COMMANDS)


# Each allowed command: its args, the target call it makes, the result sent back, whether `reported` follows.
EVERY_COMMAND = {
    "get_status": ({}, None, {"active_tiers": {"llm": "small", "asr": "ctc"}, "pins": {}}, False),
    "set_sla": ({"workload": "llm", "sla": {"target_ms": 300}}, ("set_sla", "llm"), None, True),
    "pin_tier": ({"workload": "llm", "tier": "tiny"}, ("pin_tier", ("llm", "tiny")), None, True),
    "unpin_tier": ({"workload": "llm"}, ("unpin_tier", "llm"), {"value": None}, True),
    "rebuild_engine": ({"recipe": "phi3-int8"}, ("rebuild_engine", "phi3-int8"), None, False),
    "flush_telemetry": ({}, None, {"flushed": True}, False),
    "reset_desired": ({}, None, {"forgotten_version": None, "reload": "reloaded", "desired_version": None}, True),
}


@pytest.mark.parametrize("name", sorted(EVERY_COMMAND))
def test_every_allowed_command_runs_its_own_target_call(rig, name):
    from edge_agent.telemetry.command_args import ALLOWED

    assert set(EVERY_COMMAND) == set(ALLOWED)
    proc, agent, sent, reported, *_ = rig
    args, call, result, reports = EVERY_COMMAND[name]
    proc.handle(msg(name, {"cmd_id": f"{name}-1", "args": args}))
    assert statuses(sent) == ["accepted", "executing", "succeeded"], sent[-1]
    assert agent.calls == ([call] if call else [])
    assert agent.flushes == (name == "flush_telemetry")
    if result is not None:
        assert sent[-1][1]["result"] == result
    assert bool(reported) == reports


def test_signed_commands_and_desired_with_a_fleet_key(tmp_path):
    ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    from edge_agent.telemetry.signing import Verifier, sign

    key = ed25519.Ed25519PrivateKey.generate()
    agent, sent, reported, wall = TinyAgent(), [], [], Clock(1.7e9)
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev-1",
        lambda t, b, c: sent.append(json.loads(b)),
        reported.append,
        wall=wall,
        verifier=Verifier(key.public_key(), wall),
    )
    topic = f"{PREFIX}/cmd/pin_tier/req"
    body = json.dumps({"cmd_id": "s1", "args": {"workload": "llm", "tier": "tiny"}}).encode()
    proc.handle(Incoming(topic, body, None, None, None, False))
    assert sent[-1]["status"] == "rejected" and sent[-1]["reason"].startswith("unsigned") and sent[-1]["cmd_id"] == "s1"
    proc.handle(Incoming(topic, sign(key, topic, body, int(wall.t) - 1), None, None, None, False))
    assert sent[-1]["status"] == "rejected" and "expired" in sent[-1]["reason"]
    assert agent.pins == {}
    proc.handle(Incoming(topic, sign(key, topic, body, int(wall.t) + 60), None, None, None, False))
    assert sent[-1]["status"] == "succeeded" and agent.pins == {"llm": "tiny"}

    desired = f"{PREFIX}/desired"
    forged = json.dumps({"version": 999999, "pins": {"llm": "small"}}).encode()
    proc.handle(Incoming(desired, forged, None, None, None, True))
    assert agent.pins == {"llm": "tiny"} and "unsigned" in reported[-1]["desired_error"]
    assert reported[-1]["desired_version"] is None
    good = json.dumps({"version": 5, "pins": {"llm": "small"}}).encode()
    proc.handle(Incoming(desired, sign(key, desired, good, int(wall.t) + 3600), None, None, None, True))
    assert agent.pins == {"llm": "small"} and reported[-1]["desired_version"] == 5
    assert proc.stats["unsigned"] == 3  # the unsigned and the expired command, the forged desired


def test_reset_desired_lets_a_lower_version_apply(tmp_path):
    agent, sent, reported = TinyAgent(), [], []
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev-1",
        lambda t, b, c: sent.append(json.loads(b)),
        reported.append,
    )
    assert proc.apply_desired(json.dumps({"version": 999999, "pins": {"llm": "tiny"}}).encode())
    assert not proc.apply_desired(json.dumps({"version": 5, "pins": {"llm": "small"}}).encode())
    proc.handle(msg("reset_desired", {"cmd_id": "r1"}, response_topic=None))
    assert sent[-1]["status"] == "succeeded", sent[-1]
    assert reported[-1]["desired_version"] is None
    assert proc.apply_desired(json.dumps({"version": 5, "pins": {"llm": "small"}}).encode())
    assert agent.pins == {"llm": "small"} and reported[-1]["desired_version"] == 5


def test_a_flood_logs_one_line_per_period_and_reports_the_drops(rig, caplog):
    proc, _agent, _sent, _rep, clock, _wall = rig
    events: list[dict] = []
    proc.on_drops = events.append
    with caplog.at_level("WARNING", logger="edge_agent.telemetry.remote_commands"):
        for k in range(MAX + 50):  # the worker is not running: the queue fills, then overflows
            proc.submit(msg("get_status", {"cmd_id": f"f{k}"}))
        proc.report_drops()
        for k in range(30):
            proc.submit(msg("get_status", {"cmd_id": f"g{k}"}))
        proc.report_drops()  # within the period: nothing yet
        clock.t += 10.5
        proc.submit(msg("get_status", {"cmd_id": "h"}))
        proc.report_drops()
    lines = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
    assert len(lines) == 2 and "79 more like it" in lines[1], lines
    assert [e["counts"] for e in events] == [{"queue_full": 50}, {"queue_full": 31}]
    assert events[-1]["total"] == 81 == proc.stats["overflow"]


def test_rejections_in_a_flood_are_logged_once_per_period(rig, caplog):
    proc, _agent, sent, *_ = rig
    with caplog.at_level("WARNING", logger="edge_agent.telemetry.remote_commands"):
        for k in range(100):
            proc.handle(msg("get_status", b"{not json"))
            proc.handle(msg("get_status", {"cmd_id": f"o{k}"}, response_topic="edge/v1/OTHER/state"))
    assert statuses(sent).count("rejected") == 200  # every sender still gets its answer
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
