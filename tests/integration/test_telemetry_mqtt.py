"""Telemetry against a real mosquitto on 127.0.0.1 and a free port: birth, will, spool, TLS, auth, ACL, commands."""

from __future__ import annotations

import json
import time

import pytest

from tests.mqtt_broker import Broker, Certs, TcpProxy, free_port, wait_for
from tests.telemetry_helpers import Load, Watcher, assert_no_gaps, drained, make_telemetry
from tests.telemetry_target import TinyAgent


@pytest.fixture
def broker(tmp_path):
    with Broker(tmp_path / "broker") as b:
        yield b


@pytest.fixture
def watcher(broker):
    w = Watcher(broker.port)
    yield w
    w.close()


def test_birth_windows_acked_out_of_the_spool_and_clean_offline(tmp_path, broker, watcher):
    tele = make_telemetry(tmp_path, broker.port, target=TinyAgent()).start()
    with Load(tele):
        wait_for(lambda: len(watcher.seqs()) >= 5, 20, what="five windows")
    drained(tele)
    state = watcher.docs("dev-1/state")
    assert state[0]["state"] == "online" and state[0]["session"] == tele.spool.session
    meta = watcher.docs("dev-1/meta")[0]
    assert meta["tiers"] == {"llm": ["small", "tiny"], "asr": ["ctc"]} and 0 < meta["histogram_relative_error"] < 0.02
    assert watcher.docs("dev-1/reported")[0]["active_tiers"]["llm"] == "small"
    tele.set_state("degraded", "tier tiny pinned: SLA broken")
    wait_for(lambda: watcher.docs("dev-1/state")[-1]["state"] == "degraded", 10, what="degraded state")
    win = watcher.docs("tele/latency")[-1]
    assert win["series"] and win["series"][0]["histograms"]["ttft_ms"]["count"] > 0
    tele.stop()
    wait_for(lambda: watcher.docs("dev-1/state")[-1]["state"] == "offline", 10, what="offline state")
    assert watcher.docs("dev-1/state")[-1]["reason"] == "agent stopped"
    assert_no_gaps(watcher.seqs())
    # Retained: a fleet tool that connects later sees the last state at once.
    late = Watcher(broker.port, client_id="late")
    wait_for(lambda: late.docs("dev-1/state"), 10, what="retained state")
    assert late.docs("dev-1/state")[-1]["state"] == "offline"
    late.close()


def test_last_will_on_a_dead_link_and_online_again_on_reconnect(tmp_path, broker, watcher):
    with TcpProxy(broker.port) as proxy:
        tele = make_telemetry(tmp_path, proxy.port, mqtt_extra={"keepalive_s": 5}).start()
        wait_for(lambda: tele.link.connected.is_set(), 20, what="connect")
        proxy.cut()
        wait_for(lambda: any(d["state"] == "offline" for d in watcher.docs("dev-1/state")), 20, what="last will")
        assert watcher.docs("dev-1/state")[-1]["reason"] == "connection lost (last will)"
        proxy.heal()
        wait_for(lambda: watcher.docs("dev-1/state")[-1]["state"] == "online", 30, what="online after reconnect")
        assert tele.link.connects >= 2 and tele.link.callback_errors == 0
        tele.stop()


@pytest.mark.slow
def test_missing_broker_at_boot_spools_then_delivers_everything(tmp_path, broker, watcher):
    port = free_port()  # nothing listens here until the "broker" (a proxy to it) appears
    tele = make_telemetry(tmp_path, port, interval_s=0.1, live_age_s=0.5).start()
    wait_for(lambda: tele.spool.records >= 10, 20, what="windows spooled while no broker")
    assert not tele.link.connected.is_set() and tele.publisher._thread.is_alive()
    with TcpProxy(broker.port, port=port):
        wait_for(lambda: tele.link.connected.is_set(), 30, what="connect to the late broker")
        time.sleep(0.5)
        drained(tele)
        tele.stop()
    docs = watcher.docs("tele/latency")
    seqs = [d["seq"] for d in docs]
    assert min(seqs) == 1 and not docs[0]["historical"]  # the live window overtakes the backlog
    assert all(d["historical"] for d in docs if d["seq"] < 10)  # windows that waited for the broker
    assert_no_gaps(seqs)


def test_mutual_tls_with_generated_certificates(tmp_path):
    certs = Certs.generate(tmp_path / "pki", client_cn="dev-tls")
    with Broker(tmp_path / "b", tls=certs, require_client_cert=True) as broker:
        w = Watcher(
            broker.port,
            client_id="fleet",
            ca_certs=str(certs.ca),
            certfile=str(certs.client_cert),
            keyfile=str(certs.client_key),
        )
        tls = {"ca_file": certs.ca, "cert_file": certs.client_cert, "key_file": certs.client_key}
        tele = make_telemetry(tmp_path, broker.port, device_id="dev-tls", mqtt_extra={"tls": tls}).start()
        wait_for(lambda: len(w.seqs("dev-tls")) >= 3, 30, what="windows over TLS")
        tele.stop()
        w.close()


@pytest.mark.slow
def test_tls_with_an_untrusted_ca_is_refused_and_the_agent_keeps_spooling(tmp_path):
    good, other = Certs.generate(tmp_path / "pki"), Certs.generate(tmp_path / "other")
    with Broker(tmp_path / "b", tls=good) as broker:
        tele = make_telemetry(tmp_path, broker.port, interval_s=0.1, mqtt_extra={"tls": {"ca_file": other.ca}}).start()
        wait_for(lambda: tele.spool.records >= 5, 20, what="spooling while TLS fails")
        assert not tele.link.connected.is_set() and tele.link.callback_errors == 0
        tele.stop(timeout_s=1)


def test_username_password_good_and_bad(tmp_path):
    with Broker(tmp_path / "b", passwords={"dev-1": "s3cret", "fleet": "f"}) as broker:
        bad = make_telemetry(
            tmp_path / "bad", broker.port, interval_s=0.1, mqtt_extra={"username": "dev-1", "password": "wrong"}
        ).start()
        wait_for(lambda: bad.link.last_error and "refused" in bad.link.last_error, 20, what="refusal")
        wait_for(lambda: bad.spool.records >= 3, 20, what="windows spooled meanwhile")
        assert not bad.link.connected.is_set() and bad.link.callback_errors == 0
        bad.stop(timeout_s=1)
        good = make_telemetry(
            tmp_path / "good", broker.port, mqtt_extra={"username": "dev-1", "password": "s3cret"}
        ).start()
        wait_for(lambda: good.link.connected.is_set(), 20, what="authenticated connect")
        drained(good)
        good.stop()


def test_publish_denied_by_acl_is_retried_dropped_and_reported(tmp_path):
    acl = (
        "topic write edge/v1/dev-1/state\ntopic write edge/v1/dev-1/meta\n"
        "topic write edge/v1/dev-1/evt/#\ntopic read edge/v1/#\n"
    )
    with Broker(tmp_path / "b", acl=acl) as broker:
        w = Watcher(broker.port)
        tele = make_telemetry(tmp_path, broker.port, interval_s=0.5)
        tele.spool.max_attempts = 2
        tele.publisher.reject_backoff_s = 0.2
        tele.start()
        wait_for(lambda: tele.publisher.stats["rejected"] >= 2, 30, what="refused publishes")
        drops = lambda: [d for d in w.docs("evt/spool_drop") if d["data"]["reason"] == "rejected"]  # noqa: E731
        wait_for(drops, 30, what="spool_drop event for the refused window")
        assert "0x87" in drops()[0]["data"]["detail"]
        assert w.seqs() == []  # the broker really dropped them
        tele.stop(timeout_s=1)
        w.close()


def test_commands_over_mqtt5_response_topic_correlation_duplicates_and_bad_input(tmp_path, broker, watcher):
    agent = TinyAgent()
    tele = make_telemetry(tmp_path, broker.port, target=agent, tele_extra={"max_command_bytes": 1024}).start()
    wait_for(lambda: tele.link.connected.is_set(), 20, what="connect")
    time.sleep(0.3)  # let the subscription settle
    req = "edge/v1/dev-1/cmd/pin_tier/req"
    body = {"cmd_id": "c-42", "args": {"workload": "llm", "tier": "tiny"}}
    replies = lambda: [(json.loads(p), props) for t, p, props in watcher.messages if t == "fleet/replies/7"]  # noqa: E731
    watcher.request(req, body, response_topic="fleet/replies/7", correlation=b"\x00corr", expiry_s=30)
    wait_for(lambda: [r for r, _p in replies() if r["status"] == "succeeded"], 20, what="succeeded")
    got = replies()
    assert [r["status"] for r, _p in got] == ["accepted", "executing", "succeeded"]
    assert all(p.CorrelationData == b"\x00corr" for _r, p in got)
    watcher.request(req, body, response_topic="fleet/replies/7", correlation=b"\x00corr")
    wait_for(lambda: len(replies()) == 4, 20, what="duplicate answer")
    assert replies()[-1][0]["duplicate"] is True and replies()[-1][0]["status"] == "succeeded"
    assert agent.calls.count(("pin_tier", ("llm", "tiny"))) == 1
    watcher.request("edge/v1/dev-1/cmd/get_status/req", b"\xff\xfe not json", response_topic="fleet/replies/7")
    watcher.request(
        "edge/v1/dev-1/cmd/get_status/req", {"cmd_id": "big", "pad": "x" * 5000}, response_topic="fleet/replies/7"
    )
    watcher.request(
        "edge/v1/dev-1/cmd/flush_telemetry/req",
        {"cmd_id": "old", "expires_at_wall": 1.0},
        response_topic="fleet/replies/7",
    )
    wait_for(lambda: len(replies()) == 7, 20, what="three more answers")
    tail = [r for r, _p in replies()[-3:]]
    assert [r["status"] for r in tail] == ["rejected", "rejected", "expired"]
    assert "malformed" in tail[0]["reason"] and "over the 1024-byte limit" in tail[1]["reason"]
    wait_for(lambda: watcher.docs("dev-1/reported")[-1]["pins"] == {"llm": "tiny"}, 10, what="reported echo")
    assert tele.link.callback_errors == 0
    tele.stop()


def test_retained_desired_is_applied_on_connect_and_echoed(tmp_path, broker, watcher):
    desired = {
        "version": 7,
        "sla": {"llm": {"metric": "ttft_ms", "percentile": 95, "target_ms": 220}},
        "pins": {"llm": "tiny"},
    }
    watcher.client.publish("edge/v1/dev-1/desired", json.dumps(desired), qos=1, retain=True).wait_for_publish(10)
    agent = TinyAgent()
    tele = make_telemetry(tmp_path, broker.port, target=agent).start()
    wait_for(
        lambda: any(d.get("desired_version") == 7 for d in watcher.docs("dev-1/reported")),
        20,
        what="reported desired_version 7",
    )
    rep = [d for d in watcher.docs("dev-1/reported") if d.get("desired_version") == 7][-1]
    assert rep["pins"] == {"llm": "tiny"} and rep["sla"]["llm"]["target_ms"] == 220
    assert agent.pins == {"llm": "tiny"}
    tele.stop()
    watcher.client.publish("edge/v1/dev-1/desired", b"", qos=1, retain=True).wait_for_publish(10)


@pytest.mark.slow
def test_fleet_watch_cli_merges_devices_and_prints_json(tmp_path, broker):
    import subprocess
    import sys

    from tests.conftest import REPO

    teles = [make_telemetry(tmp_path, broker.port, device_id=f"dev-{k}", interval_s=0.2).start() for k in range(2)]
    loads = [Load(t, per_s=100).__enter__() for t in teles]
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "edge_agent",
                "fleet",
                "watch",
                "--broker",
                f"127.0.0.1:{broker.port}",
                "--json",
                "--duration",
                "3",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for ld in loads:
            ld.__exit__(None, None, None)
        for t in teles:
            t.stop()
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert [d["device"] for d in snap["devices"]] == ["dev-0", "dev-1"]
    assert all(d["state"] == "online" and d["count"] > 0 and d["gaps"] == 0 for d in snap["devices"])
    fleet = snap["fleet"]
    assert fleet["online"] == 2 and fleet["count"] == sum(d["count"] for d in snap["devices"])
    assert 20 <= fleet["p95_ms"] <= fleet["p99_ms"] <= 70 * 1.02
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "fleet",
            "watch",
            "--broker",
            f"127.0.0.1:{broker.port}",
            "--duration",
            "1",
            "--refresh-s",
            "0.5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0 and "FLEET (0/2 online)" in table.stdout, table.stdout + table.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "edge_agent", "fleet", "watch", "--broker", "nohost"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr and "Traceback" not in bad.stderr


def test_an_exception_in_a_callback_is_contained_and_counted(tmp_path, broker, watcher):
    class BrokenAgent(TinyAgent):
        def reported(self):
            raise RuntimeError("bug in the agent's reported()")

    tele = make_telemetry(tmp_path, broker.port, target=BrokenAgent()).start()
    wait_for(lambda: tele.link.callback_errors >= 1, 20, what="the failing birth to be counted")
    wait_for(lambda: len(watcher.seqs()) >= 3, 20, what="windows despite the failing callback")
    assert tele.link.connected.is_set() and tele.link._client._thread is not None
    tele.stop()
