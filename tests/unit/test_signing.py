"""Signed fleet messages: the envelope (checked against ``cryptography`` directly), keys, config, the
open-channel warning and the ``fleet keygen`` / ``fleet sign`` CLI."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import pytest

from edge_agent.config import MqttConfig, TelemetryConfig, load_settings
from edge_agent.errors import ConfigError
from edge_agent.telemetry.signing import Unsigned, Verifier, command_channel_warnings, load_public_key, sign
from tests.conftest import REPO

ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
from cryptography.exceptions import InvalidSignature  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402

TOPIC = "edge/v1/dev-1/cmd/get_status/req"
BODY = b'{"cmd_id": "a1", "args": {}}'


def reference_envelope(key, topic: str, payload: bytes, expires: int) -> bytes:
    """The documented format, written out independently of the code under test."""
    sig = key.sign(topic.encode() + b"\n" + str(expires).encode() + b"\n" + payload)
    return json.dumps(
        {
            "schema": "edge-agent.signed/1",
            "expires": expires,
            "payload": base64.b64encode(payload).decode(),
            "sig": base64.b64encode(sig).decode(),
        }
    ).encode()


def pub_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def pub_b64(key) -> str:
    return base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()


@pytest.fixture
def key():
    return ed25519.Ed25519PrivateKey.generate()


def test_envelope_matches_the_documented_format(key):
    env = json.loads(sign(key, TOPIC, BODY, 1_900_000_000))
    assert set(env) == {"schema", "expires", "payload", "sig"} and env["schema"] == "edge-agent.signed/1"
    assert base64.b64decode(env["payload"]) == BODY and env["expires"] == 1_900_000_000
    key.public_key().verify(base64.b64decode(env["sig"]), TOPIC.encode() + b"\n1900000000\n" + BODY)


def test_verifier_accepts_a_reference_envelope_and_refuses_everything_else(key):
    now = 1_800_000_000
    v = Verifier(key.public_key(), wall=lambda: now)
    assert v.open(TOPIC, reference_envelope(key, TOPIC, BODY, now + 60)) == BODY
    cases = {
        "unsigned": BODY,
        "expired": reference_envelope(key, TOPIC, BODY, now - 1),
        "bad signature": reference_envelope(ed25519.Ed25519PrivateKey.generate(), TOPIC, BODY, now + 60),
        "malformed": b'{"schema": "edge-agent.signed/1", "expires": "soon", "payload": "", "sig": ""}',
    }
    for reason, payload in cases.items():
        with pytest.raises(Unsigned, match=reason):
            v.open(TOPIC, payload)
    # Topic, expiry and payload are all covered by the signature.
    good = json.loads(reference_envelope(key, TOPIC, BODY, now + 60))
    for field, value in (("expires", now + 10_000), ("payload", base64.b64encode(b'{"cmd_id": "b"}').decode())):
        with pytest.raises(Unsigned, match="bad signature"):
            v.open(TOPIC, json.dumps({**good, field: value}).encode())
    with pytest.raises(Unsigned, match="bad signature"):
        v.open("edge/v1/dev-2/cmd/get_status/req", reference_envelope(key, TOPIC, BODY, now + 60))


def test_without_a_key_plain_messages_pass_and_envelopes_are_unwrapped(key):
    v = Verifier(None, wall=lambda: 1000.0)
    assert v.open(TOPIC, BODY) == BODY
    assert v.open(TOPIC, reference_envelope(key, TOPIC, BODY, 2000)) == BODY
    with pytest.raises(Unsigned, match="expired"):
        v.open(TOPIC, reference_envelope(key, TOPIC, BODY, 999))


def test_public_key_from_pem_file_or_base64(tmp_path, key):
    (tmp_path / "fleet.pub.pem").write_bytes(pub_pem(key))
    for value in (str(tmp_path / "fleet.pub.pem"), pub_b64(key)):
        loaded = load_public_key(value)
        loaded.verify(key.sign(b"x"), b"x")
        with pytest.raises(InvalidSignature):
            loaded.verify(key.sign(b"x"), b"y")


def test_a_bad_key_is_a_config_error_naming_the_key(tmp_path):
    rsa = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    (tmp_path / "rsa.pem").write_bytes(
        other.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (tmp_path / "junk.pem").write_text("not a key")
    for value, why in (
        (str(tmp_path / "missing.pem"), "No such file"),
        (str(tmp_path / "junk.pem"), "not a PEM"),
        (str(tmp_path / "rsa.pem"), "not an Ed25519"),
    ):
        cfg = tmp_path / "agent.toml"
        cfg.write_text(f'[telemetry]\nfleet_public_key = "{value}"\n')
        with pytest.raises(ConfigError, match=f"telemetry.fleet_public_key: .*{why}"):
            load_settings(cfg)


def test_config_keys_validate(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[telemetry]\ncommands_allowed = ["get_status", "format_disk"]\nreply_prefixes = ["fleet/#"]\n')
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    paths = {p for p, _m in err.value.problems}
    assert {"telemetry.commands_allowed[1]", "telemetry.reply_prefixes"} <= paths, err.value.problems


@pytest.mark.parametrize(
    "mqtt, tele, open_",
    [
        ({}, {}, True),  # anonymous, plain TCP
        ({"username": "dev-1", "password": "x"}, {}, True),  # credentials, but no TLS
        ({"tls": {"ca_file": "/ca.pem"}}, {}, True),  # TLS, but anonymous
        ({"username": "dev-1", "tls": {"ca_file": "/ca.pem"}}, {}, False),  # TLS + credentials
        ({"tls": {"cert_file": "/c.pem", "key_file": "/k.pem"}}, {}, False),  # mutual TLS
        ({}, {"fleet_public_key": "KEY"}, False),  # signed
    ],
)
def test_open_command_channel_warning(key, mqtt, tele, open_):
    tele = {k: (pub_b64(key) if v == "KEY" else v) for k, v in tele.items()}
    warnings = command_channel_warnings(MqttConfig(device_id="d", **mqtt), TelemetryConfig(**tele))
    assert bool(warnings) == open_
    if open_:
        assert "fleet_public_key" in warnings[0] and "unsigned" in warnings[0]


def test_doctor_warns_about_an_open_command_channel(tmp_path, key):
    from edge_agent.diagnostics.doctor import command_channel_warnings as doctor_warnings

    cfg = tmp_path / "agent.toml"
    cfg.write_text('[mqtt]\nhost = "broker.example"\n')
    assert "broker.example" in doctor_warnings(cfg)[0]
    cfg.write_text(f'[mqtt]\nhost = "broker.example"\n[telemetry]\nfleet_public_key = "{pub_b64(key)}"\n')
    assert doctor_warnings(cfg) == []


def test_cli_keygen_then_sign_produces_an_envelope_the_public_key_verifies(tmp_path):
    def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "edge_agent", "fleet", *args],
            cwd=REPO,
            input=stdin,
            capture_output=True,
            timeout=120,
        )

    out = cli("keygen", "--out", str(tmp_path / "fleet.pem"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "fleet.pem").stat().st_mode & 0o077 == 0
    b64 = out.stdout.decode().split('fleet_public_key = "')[1].split('"')[0]
    assert cli("keygen", "--out", str(tmp_path / "fleet.pem")).returncode != 0  # never overwrites a key
    (tmp_path / "req.json").write_bytes(BODY)
    t0 = int(time.time())
    out = cli(
        "sign",
        "--key",
        str(tmp_path / "fleet.pem"),
        "--topic",
        TOPIC,
        "--payload-file",
        str(tmp_path / "req.json"),
        "--ttl",
        "120",
    )
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert base64.b64decode(env["payload"]) == BODY and t0 + 120 <= env["expires"] <= int(time.time()) + 120
    pub = ed25519.Ed25519PublicKey.from_public_bytes(base64.b64decode(b64))
    pub.verify(base64.b64decode(env["sig"]), TOPIC.encode() + b"\n" + str(env["expires"]).encode() + b"\n" + BODY)
    # The public half written beside it is what a device loads.
    assert Verifier(load_public_key(str(tmp_path / "fleet.pub.pem"))).open(TOPIC, out.stdout.strip()) == BODY
    req = str(tmp_path / "req.json")
    bad = cli("sign", "--key", req, "--topic", TOPIC, "--payload-file", req)
    assert bad.returncode != 0 and b"Traceback" not in bad.stderr and b"req.json" in bad.stderr
