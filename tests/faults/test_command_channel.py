"""The MQTT command channel, from outside: a real ``edge-agent run``, a real mosquitto, paho MQTT 5 clients.

- A reply aimed at another device's topic (MQTT 5 response topic ``edge/v1/OTHER/state``) must not be
  published there; the device refuses the command with a reason on its own ``res`` topic.
- With ``telemetry.fleet_public_key``: unsigned, expired and wrongly signed commands are refused with a
  reason; a correctly signed one runs. A forged retained ``desired`` (version 999999, unsigned) is not
  applied, and a later signed version 5 is; a signed ``reset_desired`` lets a lower version apply again;
  a command outside ``telemetry.commands_allowed`` is refused.
- A command flood does not log one line per dropped message, and the drops are counted in telemetry.
- The shipped mosquitto ACL example confines a device to its own topics, and a real agent still works under it.

The signed envelope is built here from its documented definition (docs/telemetry.md), with
``cryptography`` directly, not with the agent's own signing code.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import pytest

from tests.daemon_proc import Daemon, config_text, free_port, wait_for
from tests.mqtt_broker import Broker

mqtt = pytest.importorskip("paho.mqtt.client")
ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")

from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OPEN, SIGNED = "dev-open", "dev-signed"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def envelope(key, topic: str, payload: bytes, expires: int) -> bytes:
    """The documented envelope: Ed25519 over ``topic \\n expires \\n payload``."""
    signed = topic.encode() + b"\n" + str(expires).encode() + b"\n" + payload
    return json.dumps(
        {"schema": "edge-agent.signed/1", "expires": expires, "payload": b64(payload), "sig": b64(key.sign(signed))}
    ).encode()


class Fleet:
    """A fleet-side MQTT 5 client that keeps every message it sees (optionally authenticated)."""

    def __init__(
        self, port: int, client_id: str, topics=("edge/v1/#",), username: str | None = None, password: str | None = None
    ) -> None:
        self.messages: list[tuple[str, bytes, object]] = []
        self.lock = threading.Lock()
        self.subscribed = threading.Event()
        self.connected = threading.Event()
        self.refused: list[object] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if username:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self.client.on_message = self._on_message
        self._topics = topics
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()

    def _on_connect(self, client, _u, _f, rc, _p=None) -> None:
        if getattr(rc, "is_failure", False):
            self.refused.append(rc)
            return
        self.connected.set()
        if self._topics:
            client.subscribe([(t, 1) for t in self._topics])

    def _on_message(self, _c, _u, m) -> None:
        with self.lock:
            self.messages.append((m.topic, bytes(m.payload), m.properties))

    def docs(self, topic: str) -> list[dict]:
        with self.lock:
            return [json.loads(p) for t, p, _ in self.messages if t == topic and p]

    def topics(self) -> set[str]:
        with self.lock:
            return {t for t, _p, _ in self.messages}

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        retain: bool = False,
        qos: int = 1,
    ):
        props = Properties(PacketTypes.PUBLISH)
        if response_topic:
            props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if qos:
            info.wait_for_publish(10)
        return info

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def start_daemon(tmp: Path, port: int, device: str, telemetry_keys: str = "") -> Daemon:
    api_port = free_port()
    cfg = config_text(tmp, port, api_port, device=device).replace("[telemetry]\n", "[telemetry]\n" + telemetry_keys)
    return Daemon(tmp, broker_port=port, config=cfg, api_port=api_port, device=device).start()


def req(cmd_id: str, **args) -> bytes:
    return json.dumps({"cmd_id": cmd_id, "args": args}).encode()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with Broker(tmp_path_factory.mktemp("broker")) as b:
        yield b


@pytest.fixture(scope="module")
def fleet(broker):
    f = Fleet(broker.port, "fleet-tests", topics=("edge/v1/#", "fleet/#"))
    assert f.subscribed.wait(15)
    yield f
    f.close()


@pytest.fixture(scope="module")
def open_daemon(broker, fleet, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("open"), broker.port, OPEN)
    wait_for(lambda: fleet.docs(f"edge/v1/{OPEN}/meta"), 30, what="meta of the open device")
    yield d
    d.close()


@pytest.fixture(scope="module")
def fleet_key():
    return ed25519.Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def signed_daemon(broker, fleet, fleet_key, tmp_path_factory):
    from cryptography.hazmat.primitives import serialization

    tmp = tmp_path_factory.mktemp("signed")
    pub = tmp / "fleet.pub.pem"
    pub.write_bytes(
        fleet_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    keys = (
        f'fleet_public_key = "{pub}"\n'
        'commands_allowed = ["get_status", "pin_tier", "unpin_tier", "set_sla", "reset_desired"]\n'
    )
    d = start_daemon(tmp, broker.port, SIGNED, keys)
    wait_for(lambda: fleet.docs(f"edge/v1/{SIGNED}/meta"), 30, what="meta of the signed device")
    yield d
    # Clear what this module left retained.
    fleet.publish(f"edge/v1/{SIGNED}/desired", b"", retain=True)
    d.close()


def answers(fleet: Fleet, topic: str, cmd_id: str) -> list[dict]:
    return [r for r in fleet.docs(topic) if r.get("cmd_id") == cmd_id]


def final(fleet: Fleet, topic: str, cmd_id: str, timeout_s: float = 20) -> dict:
    done = ("rejected", "expired", "failed", "succeeded")
    return wait_for(
        lambda: next((r for r in answers(fleet, topic, cmd_id) if r["status"] in done), None),
        timeout_s,
        what=f"final answer to {cmd_id} on {topic}",
    )


# -- fault 5: replies aimed at other devices --------------------------------------------------------


def test_reply_aimed_at_another_devices_topic_is_refused_on_own_res_topic(open_daemon, fleet):
    own = f"edge/v1/{OPEN}/cmd/get_status/res"
    fleet.publish(
        f"edge/v1/{OPEN}/cmd/get_status/req",
        req("aim-1"),
        response_topic="edge/v1/OTHER/state",
        correlation=b"corr-aim",
    )
    got = final(fleet, own, "aim-1")
    assert got["status"] == "rejected", got
    assert "edge/v1/OTHER/state" in got["reason"] and "response topic" in got["reason"], got["reason"]
    props = next(p for t, pl, p in fleet.messages if t == own and json.loads(pl).get("cmd_id") == "aim-1")
    assert props.CorrelationData == b"corr-aim"
    time.sleep(1.0)  # anything the device would still send there has arrived by now on loopback
    assert not [t for t in fleet.topics() if t.startswith("edge/v1/OTHER")], (
        "the device published on another device's topic"
    )
    # A reply topic under the device's own namespace still works.
    mine = f"edge/v1/{OPEN}/cmd/get_status/res/fleet-7"
    fleet.publish(f"edge/v1/{OPEN}/cmd/get_status/req", req("aim-2"), response_topic=mine, correlation=b"c2")
    assert final(fleet, mine, "aim-2")["status"] == "succeeded"


def test_open_command_channel_is_warned_in_meta_and_log(open_daemon, fleet):
    meta = fleet.docs(f"edge/v1/{OPEN}/meta")[-1]
    warnings = " ".join(meta.get("warnings", []))
    assert "unsigned" in warnings and "fleet_public_key" in warnings, meta
    assert "fleet_public_key" in open_daemon.output()


# -- fault 12 (part): a command flood ---------------------------------------------------------------


def test_command_flood_logs_a_bounded_number_of_lines_and_counts_the_drops(open_daemon, fleet):
    sent = 3000
    for k in range(sent):  # QoS 0, as fast as paho goes: the device's 256-deep queue overflows
        fleet.publish(f"edge/v1/{OPEN}/cmd/get_status/req", req(f"flood-{k}"), qos=0)
    events = lambda: fleet.docs(f"edge/v1/{OPEN}/evt/commands_dropped")  # noqa: E731
    wait_for(events, 40, what="a commands_dropped event")
    time.sleep(12)  # one more summary period: every drop is reported by now
    dropped = sum(sum(e["data"]["counts"].values()) for e in events())
    answered = len(
        {
            r["cmd_id"]
            for r in fleet.docs(f"edge/v1/{OPEN}/cmd/get_status/res")
            if str(r.get("cmd_id")).startswith("flood-")
        }
    )
    assert 0 < dropped <= sent - answered, (dropped, answered)
    lines = [ln for ln in open_daemon.output().splitlines() if "dropped" in ln and "command" in ln]
    assert len(lines) <= 4, f"{len(lines)} log lines for {dropped} drops:\n" + "\n".join(lines[:10])


# -- fault 6: anyone can command the device and lock the fleet out ----------------------------------


def test_unsigned_expired_and_forged_commands_are_refused_signed_ones_run(signed_daemon, fleet, fleet_key):
    topic = f"edge/v1/{SIGNED}/cmd/get_status/req"
    res = f"edge/v1/{SIGNED}/cmd/get_status/res"
    now = int(time.time())
    fleet.publish(topic, req("u-1"))
    got = final(fleet, res, "u-1")
    assert got["status"] == "rejected" and "unsigned" in got["reason"], got
    fleet.publish(topic, envelope(fleet_key, topic, req("x-1"), now - 5))
    got = final(fleet, res, "x-1")
    assert got["status"] == "rejected" and "expired" in got["reason"], got
    intruder = ed25519.Ed25519PrivateKey.generate()
    fleet.publish(topic, envelope(intruder, topic, req("f-1"), now + 300))
    got = final(fleet, res, "f-1")
    assert got["status"] == "rejected" and "signature" in got["reason"], got
    # Signed for another device's topic: not valid here (the topic is part of what is signed).
    other = f"edge/v1/{OPEN}/cmd/get_status/req"
    fleet.publish(topic, envelope(fleet_key, other, req("r-1"), now + 300))
    got = final(fleet, res, "r-1")
    assert got["status"] == "rejected" and "signature" in got["reason"], got
    fleet.publish(topic, envelope(fleet_key, topic, req("s-1"), now + 300))
    got = final(fleet, res, "s-1")
    assert got["status"] == "succeeded" and got["result"]["active_tiers"]["llm"] == "small", got


def test_disallowed_command_is_refused_even_when_signed(signed_daemon, fleet, fleet_key):
    topic = f"edge/v1/{SIGNED}/cmd/flush_telemetry/req"
    fleet.publish(topic, envelope(fleet_key, topic, req("d-1"), int(time.time()) + 300))
    got = final(fleet, f"edge/v1/{SIGNED}/cmd/flush_telemetry/res", "d-1")
    assert got["status"] == "rejected" and "commands_allowed" in got["reason"], got


def test_forged_desired_is_not_applied_signed_desired_and_reset_are(signed_daemon, fleet, fleet_key):
    desired = f"edge/v1/{SIGNED}/desired"
    reported = lambda: fleet.docs(f"edge/v1/{SIGNED}/reported")  # noqa: E731
    forged = json.dumps({"version": 999999, "sla": {"llm": {"target_ms": 1}}}).encode()
    fleet.publish(desired, forged, retain=True)
    wait_for(
        lambda: any("signed" in (r.get("desired_error") or "") for r in reported()),
        20,
        what="desired_error about the unsigned desired",
    )
    assert all(r.get("desired_version") != 999999 for r in reported())
    assert all(r.get("sla", {}).get("llm", {}).get("target_ms") != 1 for r in reported())

    v5 = json.dumps({"version": 5, "sla": {"llm": {"target_ms": 222}}}).encode()
    fleet.publish(desired, envelope(fleet_key, desired, v5, int(time.time()) + 3600), retain=True)
    wait_for(lambda: any(r.get("desired_version") == 5 for r in reported()), 20, what="desired version 5 applied")
    rep = [r for r in reported() if r.get("desired_version") == 5][-1]
    assert rep["sla"]["llm"]["target_ms"] == 222 and not rep.get("desired_error"), rep

    # A lower version is ignored until a signed reset_desired ...
    v3 = json.dumps({"version": 3, "sla": {"llm": {"target_ms": 333}}}).encode()
    fleet.publish(desired, envelope(fleet_key, desired, v3, int(time.time()) + 3600), retain=True)
    time.sleep(1.5)
    assert all(r.get("desired_version") != 3 for r in reported())
    # ... and an unsigned reset_desired is refused.
    cmd = f"edge/v1/{SIGNED}/cmd/reset_desired/req"
    res = f"edge/v1/{SIGNED}/cmd/reset_desired/res"
    fleet.publish(cmd, req("rd-0"))
    assert final(fleet, res, "rd-0")["status"] == "rejected"
    fleet.publish(cmd, envelope(fleet_key, cmd, req("rd-1"), int(time.time()) + 300))
    assert final(fleet, res, "rd-1")["status"] == "succeeded"
    # After the reset, a signed version 3 applies.
    fleet.publish(desired, envelope(fleet_key, desired, v3, int(time.time()) + 3600), retain=True)
    wait_for(lambda: any(r.get("desired_version") == 3 for r in reported()), 20, what="desired version 3 after reset")
    rep = [r for r in reported() if r.get("desired_version") == 3][-1]
    assert rep["sla"]["llm"]["target_ms"] == 333, rep


# -- the mosquitto ACL example ----------------------------------------------------------------------


def test_acl_example_confines_each_device_to_its_own_topics(tmp_path):
    acl = (ROOT / "systemd" / "mosquitto-acl.example").read_text()
    users = {"dev-a": "pa", "dev-b": "pb", "fleet": "pf"}
    with Broker(tmp_path / "acl-broker", passwords=users, acl=acl) as b:
        fl = Fleet(b.port, "fleet", topics=("edge/v1/#", "fleet/replies/#"), username="fleet", password="pf")
        a = Fleet(
            b.port,
            "dev-a",
            topics=(
                "edge/v1/dev-a/cmd/+/req",
                "edge/v1/dev-a/desired",
                "edge/v1/dev-b/cmd/+/req",
                "edge/v1/dev-b/desired",
                "edge/v1/#",
            ),
            username="dev-a",
            password="pa",
        )
        bb = Fleet(
            b.port,
            "dev-b",
            topics=("edge/v1/dev-b/cmd/+/req", "edge/v1/dev-b/desired"),
            username="dev-b",
            password="pb",
        )
        try:
            for c in (fl, a, bb):
                assert c.subscribed.wait(15) and not c.refused
            # dev-a may publish under its own prefix (state, telemetry, replies) ...
            a.publish("edge/v1/dev-a/state", b'{"own": 1}')
            a.publish("edge/v1/dev-a/cmd/get_status/res", b'{"own": 2}')
            a.publish("fleet/replies/dev-a/1", b'{"own": 3}')
            # ... but not under dev-b's, nor another device's desired or commands.
            for t in (
                "edge/v1/dev-b/state",
                "edge/v1/dev-b/cmd/pin_tier/req",
                "edge/v1/dev-b/desired",
                "edge/v1/dev-a/desired",
                "edge/v1/dev-a/cmd/pin_tier/req",
                "fleet/replies/dev-b/1",
                "fleet/replies/x",
            ):
                a.publish(t, b'{"forged": 1}')
            # The fleet commands both devices.
            fl.publish("edge/v1/dev-a/cmd/get_status/req", b'{"to": "a"}')
            fl.publish("edge/v1/dev-b/cmd/get_status/req", b'{"to": "b"}')
            fl.publish("edge/v1/dev-b/desired", b'{"to": "b-desired"}', retain=True)
            wait_for(
                lambda: bb.docs("edge/v1/dev-b/desired") and bb.docs("edge/v1/dev-b/cmd/get_status/req"),
                10,
                what="dev-b receives its own command and desired",
            )
            wait_for(lambda: fl.docs("edge/v1/dev-a/cmd/get_status/res"), 10, what="fleet sees dev-a's reply")
            wait_for(lambda: a.docs("edge/v1/dev-a/cmd/get_status/req"), 10, what="dev-a receives its own command")
            time.sleep(1.0)
            assert fl.docs("edge/v1/dev-a/state") == [{"own": 1}]
            assert fl.docs("fleet/replies/dev-a/1") == [{"own": 3}]
            forged = [t for t, p, _ in fl.messages if b"forged" in p]
            assert forged == [], f"the broker let dev-a publish on {forged}"
            assert not [t for t in a.topics() if t.startswith("edge/v1/dev-b/")], "dev-a read dev-b's topics"
            assert not [t for t, p, _ in bb.messages if b"forged" in p]
        finally:
            for c in (fl, a, bb):
                c.close()
            fl2 = Fleet(b.port, "fleet-clean", topics=(), username="fleet", password="pf")
            assert fl2.connected.wait(10)
            fl2.publish("edge/v1/dev-b/desired", b"", retain=True)
            fl2.close()


def test_the_agent_does_its_job_under_the_acl_example(tmp_path):
    """The ACL must confine, not break: a real agent authenticated as its device id publishes its
    birth and telemetry and answers a command, both on its own res topic and under fleet/replies/<id>/."""
    acl = (ROOT / "systemd" / "mosquitto-acl.example").read_text()
    with Broker(tmp_path / "acl-broker", passwords={"dev-c": "pc", "fleet": "pf"}, acl=acl) as b:
        fl = Fleet(b.port, "fleet", topics=("edge/v1/#", "fleet/replies/#"), username="fleet", password="pf")
        api_port = free_port()
        cfg = config_text(tmp_path, b.port, api_port, device="dev-c").replace(
            'device_id = "dev-c"\n', 'device_id = "dev-c"\nusername = "dev-c"\npassword = "pc"\n'
        )
        d = Daemon(tmp_path, broker_port=b.port, config=cfg, api_port=api_port, device="dev-c", listen=False)
        try:
            assert fl.subscribed.wait(15) and not fl.refused
            d.start()
            wait_for(
                lambda: (
                    fl.docs("edge/v1/dev-c/state")
                    and fl.docs("edge/v1/dev-c/meta")
                    and fl.docs("edge/v1/dev-c/reported")
                    and fl.docs("edge/v1/dev-c/tele/latency")
                ),
                30,
                what="birth messages and a telemetry window from the agent",
            )
            assert fl.docs("edge/v1/dev-c/state")[-1]["state"] == "online"
            fl.publish("edge/v1/dev-c/cmd/get_status/req", req("acl-1"))
            assert final(fl, "edge/v1/dev-c/cmd/get_status/res", "acl-1")["status"] == "succeeded"
            fl.publish("edge/v1/dev-c/cmd/get_status/req", req("acl-2"), response_topic="fleet/replies/dev-c/7")
            assert final(fl, "fleet/replies/dev-c/7", "acl-2")["status"] == "succeeded"
        finally:
            d.close()
            fl.close()
