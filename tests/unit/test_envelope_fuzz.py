"""Signed envelopes the device cannot read: every field of ``edge-agent.signed/1`` fuzzed (type, size,
range, missing), on a command topic and on ``desired``, with and without a fleet key. Whatever the
message, nothing escapes the command channel: a command gets one ``rejected`` reply with the reason,
``desired`` a refusal in ``reported.desired_error``, and a flood of them costs a bounded number of log
lines and is counted in ``commands_dropped``."""

from __future__ import annotations

import base64
import json
import logging

import pytest

from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import MAX_QUEUE, CommandProcessor
from edge_agent.telemetry.signing import Unsigned, Verifier
from tests.telemetry_target import TinyAgent

ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")

PREFIX = "edge/v1/dev-1"
CMD = f"{PREFIX}/cmd/get_status/req"
DESIRED = f"{PREFIX}/desired"
NOW = 1_700_000_000.0
BODY = {CMD: b'{"cmd_id": "z1", "args": {}}', DESIRED: b'{"version": 7, "pins": {"llm": "tiny"}}'}
KEY = ed25519.Ed25519PrivateKey.generate()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def envelope(topic: str, **tokens: str | None) -> bytes:
    """A valid signed envelope for ``topic``, with some fields replaced by raw JSON text (so that
    NaN, Infinity and integers of any size can be written) or left out (None)."""
    expires = int(NOW) + 60
    body = BODY[topic]
    sig = KEY.sign(topic.encode() + b"\n" + str(expires).encode() + b"\n" + body)
    fields: dict[str, str | None] = {
        "schema": '"edge-agent.signed/1"',
        "expires": str(expires),
        "payload": json.dumps(base64.b64encode(body).decode()),
        "sig": json.dumps(base64.b64encode(sig).decode()),
        **tokens,
    }
    return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items() if v is not None) + "}").encode()


NUMBERS = {
    "huge_negative_int": "-1" + "0" * 400,
    "huge_int": "1" + "0" * 400,
    "int64_overflow": str(2**63),
    "int_past_python_digit_limit": "9" * 5000,
    "float_overflow": "1e400",
    "negative_float_overflow": "-1e400",
    "nan": "NaN",
    "infinity": "Infinity",
    "minus_infinity": "-Infinity",
    "float": "1767225600.5",
    "negative": "-1",
    "zero": "0",
    "true": "true",
    "null": "null",
    "empty_list": "[]",
    "empty_object": "{}",
    "nested_object": '{"a": {"b": {"c": [1, {"d": null}]}}}',
    "deeply_nested": "[" * 5000 + "]" * 5000,
    "number_as_string": '"1767225600"',
    "long_string": json.dumps("9" * 20_000),
}
STRINGS = {
    "not_base64": '"not base64!"',
    "long_base64": json.dumps("QUFB" * 5000),
    "empty": '""',
    "unicode": json.dumps("\u00e9\u00e8\u2603" * 100),
    "int": "12",
}
CASES: dict[str, dict[str, str | None]] = {
    **{f"expires={n}": {"expires": v} for n, v in NUMBERS.items()},
    **{f"payload={n}": {"payload": v} for n, v in {**NUMBERS, **STRINGS}.items()},
    **{f"sig={n}": {"sig": v} for n, v in {**NUMBERS, **STRINGS}.items()},
    **{f"schema={n}": {"schema": v} for n, v in {**NUMBERS, **STRINGS}.items()},
    **{f"missing {f}": {f: None} for f in ("schema", "expires", "payload", "sig")},
    "extra key": {"x": "1"},
    "many extra keys": {f"k{i}": "1" for i in range(500)},
    "very long extra key": {"k" * 10_000: "1"},
    "deeply nested extra key": {"x": '{"a": ' * 3000 + "1" + "}" * 3000},
}


def _base64_string(token: str | None) -> bool:
    try:
        value = json.loads(token) if token is not None else None
        return isinstance(value, str) and base64.b64decode(value, validate=True) is not None
    except (ValueError, RecursionError):
        return False


# Without a fleet key the signature is not checked (docs/telemetry.md: a device without the key unwraps
# envelopes, checking only the expiry), so a 'sig' that is any base64 string is read, not refused.
SIG_UNCHECKED = {c for c, tokens in CASES.items() if c.startswith("sig=") and _base64_string(tokens["sig"])}


def processor(tmp_path, key):
    agent, sent, reported = TinyAgent(), [], []
    clock, wall = Clock(100.0), Clock(NOW)
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "ledger.sqlite"),
        PREFIX,
        "dev-1",
        lambda _t, body, _c: sent.append(json.loads(body)),
        reported.append,
        max_bytes=64 * 1024,  # large enough that every case reaches the envelope parser
        clock=clock,
        wall=wall,
        verifier=Verifier(key, wall),
    )
    return proc, agent, sent, reported


@pytest.mark.parametrize("keyed", [True, False], ids=["fleet key", "no key"])
def test_the_unmutated_envelope_is_accepted(tmp_path, keyed):
    proc, agent, sent, reported = processor(tmp_path, KEY.public_key() if keyed else None)
    proc.handle(Incoming(CMD, envelope(CMD), None, None, None, False))
    assert [m["status"] for m in sent] == ["accepted", "executing", "succeeded"]
    proc.handle(Incoming(DESIRED, envelope(DESIRED), None, None, None, True))
    assert agent.pins == {"llm": "tiny"} and reported[-1]["desired_version"] == 7


@pytest.mark.parametrize("keyed", [True, False], ids=["fleet key", "no key"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_unreadable_envelope_is_refused_with_a_reason(tmp_path, case, keyed):
    proc, agent, sent, reported = processor(tmp_path, KEY.public_key() if keyed else None)
    if not keyed and case in SIG_UNCHECKED:  # readable: it runs, as documented
        proc.handle(Incoming(CMD, envelope(CMD, **CASES[case]), None, None, None, False))
        assert [m["status"] for m in sent] == ["accepted", "executing", "succeeded"]
        return
    proc.handle(Incoming(CMD, envelope(CMD, **CASES[case]), None, None, None, False))
    assert [m["status"] for m in sent] == ["rejected"], sent
    assert sent[0]["reason"], sent
    proc.handle(Incoming(DESIRED, envelope(DESIRED, **CASES[case]), None, None, None, True))
    assert reported and reported[-1]["desired_error"], reported
    assert reported[-1]["desired_version"] is None
    assert agent.calls == [] and agent.pins == {}


@pytest.mark.parametrize("case", list(CASES))
def test_the_verifier_raises_nothing_but_a_refusal(case):
    for key in (KEY.public_key(), None):
        try:
            Verifier(key, lambda: NOW).open(CMD, envelope(CMD, **CASES[case]))
        except Unsigned as exc:
            assert str(exc)
        # Without a key, what is not an envelope passes through to the request parser, which refuses it.


def test_a_flood_of_malformed_envelopes_is_answered_counted_and_logged_once(tmp_path, caplog):
    """The reported fault: ``expires`` -10**400 raised OverflowError in the worker, a traceback per
    message, no reply, nothing counted. Run through the worker's own loop, in batches the queue takes."""
    proc, agent, sent, reported = processor(tmp_path, None)
    events: list[dict] = []
    proc.on_drops = events.append
    bad = envelope(CMD, expires=NUMBERS["huge_negative_int"])
    with caplog.at_level(logging.DEBUG, logger="edge_agent.telemetry"):
        for start in range(0, 2000, MAX_QUEUE - 1):
            for _ in range(min(MAX_QUEUE - 1, 2000 - start)):
                proc.submit(Incoming(CMD, bad, None, None, None, False))
            proc._queue.put(None)
            proc._run()  # the worker's loop, on this thread: it returns at the None
        proc.handle(Incoming(DESIRED, envelope(DESIRED, expires=NUMBERS["huge_negative_int"]), None, None, None, True))
    assert len(sent) == 2000 and {m["status"] for m in sent} == {"rejected"}
    assert all("malformed envelope" in m["reason"] for m in sent)
    assert "malformed envelope" in reported[-1]["desired_error"]
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 2 and not any(r.exc_info for r in lines), [r.getMessage() for r in lines]
    proc.report_drops(force=True)
    assert sum(e["counts"].get("malformed_envelope", 0) for e in events) == 2001 == proc.stats["dropped"]
    assert proc.stats["errors"] == 0
    assert agent.calls == []
