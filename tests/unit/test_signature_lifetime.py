"""A signature is not valid for ever: a device refuses a signed command or ``desired`` whose expiry lies
further ahead than ``telemetry.max_signature_lifetime_s`` (plus a small allowance for clock
difference), so a leaked signed message cannot be replayed for years. The clock is a fake one."""

from __future__ import annotations

import base64
import json

import pytest

from edge_agent.config import load_settings
from edge_agent.errors import ConfigError
from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import CommandProcessor
from edge_agent.telemetry.signing import CLOCK_SKEW_S, Unsigned, Verifier
from tests.telemetry_target import TinyAgent

ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")

PREFIX = "edge/v1/dev-1"
CMD = f"{PREFIX}/cmd/pin_tier/req"
DESIRED = f"{PREFIX}/desired"
NOW = 1_700_000_000
DAY = 86_400
KEY = ed25519.Ed25519PrivateKey.generate()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def signed(topic: str, payload: bytes, expires: int) -> bytes:
    """The documented envelope, written out independently of the code under test (any size of integer)."""
    sig = KEY.sign(topic.encode() + b"\n" + str(expires).encode() + b"\n" + payload)
    return json.dumps(
        {
            "schema": "edge-agent.signed/1",
            "expires": expires,
            "payload": base64.b64encode(payload).decode(),
            "sig": base64.b64encode(sig).decode(),
        }
    ).encode()


BODY = b'{"cmd_id": "p1", "args": {"workload": "llm", "tier": "tiny"}}'


@pytest.mark.parametrize("keyed", [True, False], ids=["fleet key", "no key"])
def test_an_expiry_beyond_the_maximum_lifetime_is_refused_with_the_reason(keyed):
    wall = Clock(NOW)
    v = Verifier(KEY.public_key() if keyed else None, wall, max_lifetime_s=DAY)
    assert v.open(CMD, signed(CMD, BODY, NOW + 300)) == BODY
    assert v.open(CMD, signed(CMD, BODY, NOW + DAY)) == BODY  # exactly the limit
    assert v.open(CMD, signed(CMD, BODY, NOW + DAY + int(CLOCK_SKEW_S))) == BODY  # a device clock behind the fleet's
    for expires in (NOW + DAY + int(CLOCK_SKEW_S) + 1, NOW + 30 * DAY, 2**63 - 1):
        with pytest.raises(Unsigned, match=r"valid for too long.*telemetry\.max_signature_lifetime_s = 86400 s"):
            v.open(CMD, signed(CMD, BODY, expires))
    with pytest.raises(Unsigned):  # 10**400: no time at all
        v.open(CMD, signed(CMD, BODY, 10**400))
    # The limit moves with the device's clock: what was too far ahead is fine a day later.
    far = signed(CMD, BODY, NOW + 2 * DAY)
    with pytest.raises(Unsigned, match="valid for too long"):
        v.open(CMD, far)
    wall.t += DAY
    assert v.open(CMD, far) == BODY


def test_a_shorter_lifetime_is_honoured():
    v = Verifier(KEY.public_key(), Clock(NOW), max_lifetime_s=600)
    assert v.open(CMD, signed(CMD, BODY, NOW + 600)) == BODY
    with pytest.raises(Unsigned, match="= 600 s"):
        v.open(CMD, signed(CMD, BODY, NOW + 3600))


def test_the_default_is_one_day():
    v = Verifier(KEY.public_key(), Clock(NOW))
    assert v.open(CMD, signed(CMD, BODY, NOW + DAY)) == BODY
    with pytest.raises(Unsigned, match="valid for too long"):
        v.open(CMD, signed(CMD, BODY, NOW + 10 * DAY))


def test_a_command_or_desired_signed_for_too_long_does_not_run(tmp_path):
    agent, sent, reported, wall = TinyAgent(), [], [], Clock(NOW)
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev-1",
        lambda _t, b, _c: sent.append(json.loads(b)),
        reported.append,
        wall=wall,
        verifier=Verifier(KEY.public_key(), wall, max_lifetime_s=DAY),
    )
    proc.handle(Incoming(CMD, signed(CMD, BODY, NOW + 365 * DAY), None, None, None, False))
    assert [m["status"] for m in sent] == ["rejected"] and sent[0]["cmd_id"] == "p1"
    assert "max_signature_lifetime_s" in sent[0]["reason"] and agent.pins == {}
    doc = b'{"version": 3, "pins": {"llm": "tiny"}}'
    proc.handle(Incoming(DESIRED, signed(DESIRED, doc, NOW + 30 * DAY), None, None, None, True))
    assert agent.pins == {} and "max_signature_lifetime_s" in reported[-1]["desired_error"]
    proc.handle(Incoming(DESIRED, signed(DESIRED, doc, NOW + DAY), None, None, None, True))
    assert agent.pins == {"llm": "tiny"} and reported[-1]["desired_version"] == 3


def test_the_setting_is_read_from_the_file_and_the_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[telemetry]\nmax_signature_lifetime_s = 3600\n")
    assert load_settings(cfg).telemetry.max_signature_lifetime_s == 3600
    assert load_settings(None).telemetry.max_signature_lifetime_s == DAY
    monkeypatch.setenv("EDGE_AGENT_TELEMETRY__MAX_SIGNATURE_LIFETIME_S", "600")
    assert load_settings(cfg).telemetry.max_signature_lifetime_s == 600
    monkeypatch.setenv("EDGE_AGENT_TELEMETRY__MAX_SIGNATURE_LIFETIME_S", "0")
    with pytest.raises(ConfigError, match=r"telemetry\.max_signature_lifetime_s"):
        load_settings(cfg)
