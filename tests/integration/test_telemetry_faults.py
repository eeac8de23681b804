"""Fault tests on a real mosquitto (127.0.0.1, free port) and a loopback TCP proxy. Bounded waits only.

A PUBACK is not delivery (MQTT 5 acknowledges "no matching subscribers" too): a message the broker
acknowledges while no subscriber holds a session is gone. The watcher here is what a fleet consumer
should be: a persistent session on a persistent broker; where a broker dies without saving
(SIGKILL), a proxy keeps the agent away until the watcher has resubscribed, so the test measures the
agent's guarantee, not the broker's.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from tests.conftest import REPO
from tests.mqtt_broker import Broker, TcpProxy, free_port, wait_for
from tests.telemetry_helpers import Load, Watcher, assert_no_gaps, drained, make_telemetry

# Broker restarts, cuts and kills under load: seconds each (scripts/test --all).
pytestmark = pytest.mark.slow


@pytest.fixture
def pbroker(tmp_path):
    with Broker(tmp_path / "broker", persistence=True) as b:
        yield b


def test_graceful_broker_restarts_under_load_lose_nothing(tmp_path, pbroker):
    w = Watcher(pbroker.port, persistent=True, client_id="fleet-graceful")
    tele = make_telemetry(tmp_path, pbroker.port, interval_s=0.1).start()
    with Load(tele):
        wait_for(lambda: len(w.seqs()) >= 5, 20, what="first windows")
        for _ in range(2):
            pbroker.restart()
            wait_for(lambda: tele.link.connected.is_set() and w.client.is_connected(), 30, what="both back")
            time.sleep(1.0)
    drained(tele)
    tele.stop()
    time.sleep(0.5)
    assert tele.link.connects >= 3 and tele.link.callback_errors == 0
    assert_no_gaps(w.seqs())
    w.close()


def test_broker_sigkill_under_load_loses_nothing_after_dedup(tmp_path, pbroker):
    w = Watcher(pbroker.port, persistent=True, client_id="fleet-kill")
    with TcpProxy(pbroker.port) as proxy:
        tele = make_telemetry(tmp_path, proxy.port, interval_s=0.1).start()
        with Load(tele):
            wait_for(lambda: len(w.seqs()) >= 5, 20, what="first windows")
            for _ in range(2):
                pbroker.kill()
                proxy.cut()
                wait_for(lambda: not tele.link.connected.is_set(), 30, what="agent sees the broker gone")
                time.sleep(0.5)
                pbroker.start()
                wait_for(w.client.is_connected, 30, what="watcher back")
                w.subscribed.clear()
                w.client.subscribe("edge/v1/+/#", qos=1)
                assert w.subscribed.wait(10)
                proxy.heal()
                wait_for(tele.link.connected.is_set, 30, what="agent back")
                time.sleep(1.0)
        drained(tele)
        tele.stop()
    time.sleep(0.5)
    seqs = w.seqs()
    assert_no_gaps(seqs)
    assert tele.link.callback_errors == 0


def test_network_cut_and_heal_loses_nothing(tmp_path):
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        w = Watcher(broker.port)
        tele = make_telemetry(tmp_path, proxy.port, interval_s=0.1, live_age_s=0.5).start()
        with Load(tele):
            wait_for(lambda: len(w.seqs()) >= 3, 20, what="first windows")
            proxy.cut()
            wait_for(lambda: not tele.link.connected.is_set(), 20, what="agent notices the cut")
            time.sleep(2.0)
            held = tele.spool.records
            assert held >= 10, "windows wait in the spool during the cut"
            proxy.heal()
            wait_for(tele.link.connected.is_set, 30, what="reconnect")
            drained(tele)
        tele.stop()
        time.sleep(0.3)
        docs = w.docs("tele/latency")
        assert_no_gaps([d["seq"] for d in docs])
        assert sum(d["historical"] for d in docs) >= 10
        w.close()


@pytest.mark.slow
def test_blackholed_link_is_detected_by_keepalive_and_nothing_is_lost(tmp_path):
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        w = Watcher(broker.port)
        tele = make_telemetry(
            tmp_path, proxy.port, interval_s=0.2, live_age_s=0.5, mqtt_extra={"keepalive_s": 5}
        ).start()
        with Load(tele):
            wait_for(lambda: len(w.seqs()) >= 3, 20, what="first windows")
            proxy.blackhole()  # packets vanish; no RST, no FIN
            wait_for(lambda: not tele.link.connected.is_set(), 30, what="keepalive to detect the dead link")
            assert tele.spool.records > 0
            proxy.cut()  # drop the stale connections, then let traffic through again
            proxy.heal()
            wait_for(tele.link.connected.is_set, 30, what="reconnect")
            drained(tele)
        tele.stop()
        time.sleep(0.3)
        assert_no_gaps(w.seqs())
        w.close()


def _spool_rows(path) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10) as conn:
        return conn.execute("SELECT COUNT(*) FROM records WHERE kind = 'window'").fetchone()[0]


def test_agent_kill9_during_outage_keeps_the_spool_and_the_next_run_replays_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    work = tmp_path / "agent"
    work.mkdir()
    spool = work / "dev-1.spool.sqlite"
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        w = Watcher(broker.port)
        cmd = [sys.executable, "-m", "tests.telemetry_agent_proc", str(proxy.port), str(work), "0.1"]
        first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert first.stdout.readline().strip() == "session 1"
            wait_for(lambda: len(w.seqs()) >= 3, 30, what="first run's windows")
            proxy.cut()
            wait_for(lambda: _spool_rows(spool) >= 20, 30, what="windows spooled in the outage")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        spooled = _spool_rows(spool)
        proxy.heal()
        second = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert second.stdout.readline().strip() == "session 2"
            wait_for(
                lambda: any(d["session"] == 2 and not d["historical"] for d in w.docs("tele/latency")),
                30,
                what="second run live",
            )
            wait_for(lambda: _spool_rows(spool) <= 3, 60, what="replay of the first run's spool")
        finally:
            second.send_signal(signal.SIGKILL)
            second.wait(10)
        time.sleep(0.3)
        docs = w.docs("tele/latency")
        w.close()
    first_run = {d["seq"] for d in docs if d["session"] == 1}
    replayed = {d["seq"] for d in docs if d["session"] == 1 and d["historical"]}
    assert len(replayed) >= spooled - 2
    assert min(d["seq"] for d in docs if d["session"] == 2) == max(first_run) + 1  # seq survives the crash
    assert_no_gaps([d["seq"] for d in docs])


def test_corrupt_spool_at_start_is_reported_over_mqtt_and_telemetry_goes_on(tmp_path):
    spool = tmp_path / "dev-1.spool.sqlite"
    spool.write_bytes(b"\x00garbage, not a database" * 200)
    with Broker(tmp_path / "b") as broker:
        w = Watcher(broker.port)
        tele = make_telemetry(tmp_path, broker.port).start()
        wait_for(lambda: w.docs("evt/spool_drop"), 20, what="spool_drop event")
        drop = w.docs("evt/spool_drop")[0]["data"]
        assert drop["reason"] == "corrupt" and str(spool) in drop["detail"] and ".corrupt-" in drop["detail"]
        wait_for(lambda: len(w.seqs()) >= 3, 20, what="windows after recovery")
        tele.stop()
        w.close()
    assert list(tmp_path.glob("dev-1.spool.sqlite.corrupt-*"))


@pytest.mark.slow
def test_link_flapping_for_60_s_keeps_memory_and_threads_bounded(tmp_path):
    """60 s of the link going down and up every 0.5-2.5 s under load (the issue's scenario).

    The fleet side is mosquitto_sub in its own process, so this process's heap is the agent's only.
    """
    rng = random.Random(3)
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        out = (tmp_path / "sub.jsonl").open("w")
        sub = subprocess.Popen(
            [
                "mosquitto_sub",
                "-V",
                "mqttv5",
                "-q",
                "1",
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-t",
                "edge/v1/+/tele/latency",
                "-F",
                "%p",
            ],
            stdout=out,
        )
        try:
            time.sleep(0.5)
            tele = make_telemetry(tmp_path, proxy.port, interval_s=0.1, live_age_s=0.5).start()
            wait_for(tele.link.connected.is_set, 20, what="connect")
            gc.collect()
            tracemalloc.start()
            threads_before = threading.active_count()
            flaps = 0
            with Load(tele):
                time.sleep(3)
                base = tracemalloc.take_snapshot()
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    proxy.cut()
                    time.sleep(rng.uniform(0.5, 2.5))
                    proxy.heal()
                    time.sleep(rng.uniform(0.5, 2.5))
                    flaps += 1
                    threads_mid = threading.active_count() - sum(
                        t.name.startswith("proxy") for t in threading.enumerate()
                    )
                    assert threads_mid <= threads_before + 1, [t.name for t in threading.enumerate()]
                wait_for(tele.link.connected.is_set, 30, what="final reconnect")
                drained(tele, 90)
                gc.collect()
                diff = tracemalloc.take_snapshot().compare_to(base, "filename")
            tracemalloc.stop()
            tele.stop()
            time.sleep(1.0)
        finally:
            sub.terminate()
            sub.wait(10)
            out.close()
    grown = sum(d.size_diff for d in diff if "edge_agent" in str(d.traceback) or "paho" in str(d.traceback))
    top = sorted(diff, key=lambda d: -d.size_diff)[:5]
    assert flaps >= 15
    assert tele.link.connects >= flaps // 2 and tele.link.callback_errors == 0
    assert grown < 1024 * 1024, f"memory grew by {grown} bytes over {flaps} flaps: {top}"
    seqs = [json.loads(line)["seq"] for line in (tmp_path / "sub.jsonl").read_text().splitlines() if line.strip()]
    assert len(seqs) >= 500
    assert_no_gaps(seqs)


def test_disk_full_during_an_outage_loses_only_what_it_reports(tmp_path):
    """A full disk (SQLITE_FULL, injected by capping the database's pages) drops the oldest windows;
    after the outage every missing seq is one a spool_drop event named, and nothing else is missing."""
    with Broker(tmp_path / "b") as broker:
        w = Watcher(broker.port)
        port = free_port()
        tele = make_telemetry(tmp_path, port, interval_s=0.05, live_age_s=0.5)
        conn = tele.spool._conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages + 40}")
        tele.start()
        with Load(tele):
            wait_for(lambda: tele.publisher.stats["events"] >= 2, 60, what="disk_full drops to be reported")
            with TcpProxy(broker.port, port=port):
                wait_for(tele.link.connected.is_set, 30, what="broker back")
                time.sleep(1.0)
                drained(tele)
                tele.stop()
        time.sleep(0.3)
        seqs = set(w.seqs())
        reported = set()
        for d in w.docs("evt/spool_drop"):
            assert d["data"]["reason"] == "disk_full" and "disk full" in d["data"]["detail"]
            for lo, hi in d["data"]["seq_ranges"]:
                reported.update(range(lo, hi + 1))
        w.close()
    assert reported, "the loss was reported with its seq ranges"
    missing = set(range(1, max(seqs) + 1)) - seqs
    assert missing == reported
