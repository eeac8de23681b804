"""The daemon's process lifecycle, from outside: real ``edge-agent run`` processes, a real mosquitto.

- A second instance on the same state (spool, ledger, ``seq``) must exit at once, naming the first
  one's PID, without touching MQTT (no extra retained ``offline``, no session bump) or loading models.
- SIGTERM while a background engine build runs must exit 0 (no ``terminate called``, no core dump)
  and leave no half-written entry in the engine cache.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_proc import Daemon, config_text, free_port, wait_for
from tests.mqtt_broker import Broker

pytest.importorskip("paho.mqtt.client")

ROOT = Path(__file__).resolve().parents[2]

# demo-phi3-small in fp32 + fp16 + int8 (calibrated): ~15 s of native work on a small CPU, so SIGTERM lands
# inside ONNX Runtime (the first seconds of a fresh device).
RECIPE = f"""
name = "small-phi3"
model = "demo-phi3-small"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "fp16", "int8"]
[calibration]
data = "{ROOT}/calibration/llm/prompts.jsonl"
samples = 64
method = "minmax"
max_tokens = 32
[heldout]
data = "{ROOT}/calibration/llm/heldout.jsonl"
samples = 40
[accuracy]
min_cosine = 0.5
min_top1 = 0.1
max_kl = 5.0
"""


def session_counter(spool: Path) -> int:
    """The spool's session counter (read-only; the WAL lets us read beside the running writer)."""
    conn = sqlite3.connect(f"file:{spool}?mode=ro", uri=True, timeout=5)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'session'").fetchone()
    finally:
        conn.close()
    return int(row[0]) if row else 0


def offline_states(daemon: Daemon) -> int:
    assert daemon.listener is not None
    return sum(1 for s in daemon.listener.of("state") if s.get("state") == "offline")


def test_a_second_instance_on_the_same_state_exits_at_once_and_leaves_the_first_alone(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    first = Daemon(tmp_path / "first", broker_port=broker.port)
    second = None
    try:
        first.start()
        assert first.proc is not None
        wait_for(
            lambda: any(s.get("state") == "online" for s in first.listener.of("state")),
            20,
            what="the first instance online",
        )
        spool = first.workdir / "spool.sqlite"
        session_before, offline_before = session_counter(spool), offline_states(first)
        # Same device id, spool and ledger (the first's config text), another API port.
        api_port = free_port()
        second = Daemon(
            tmp_path / "second",
            broker_port=broker.port,
            api_port=api_port,
            listen=False,
            config=config_text(first.workdir, broker.port, api_port),
        )
        t0 = time.monotonic()
        second.start(wait_ready=False)
        try:
            code: int | None = second.wait(15)
        except subprocess.TimeoutExpired:
            code = None  # still running: it took over the device's identity
        exit_s = time.monotonic() - t0
        time.sleep(3)  # a kicked-off first instance would reconnect and re-publish within this
        out = second.close()
        offline_added = offline_states(first) - offline_before
        session_added = session_counter(spool) - session_before
        print(
            f"second instance: exit {code} after {exit_s:.2f} s; retained offline states +{offline_added}, "
            f"session +{session_added}; said: {out.strip()[-300:]}"
        )
        assert code is not None and code != 0, f"the second instance kept running ({exit_s:.0f} s):\n{out[-2000:]}"
        assert exit_s < 10, f"took {exit_s:.1f} s to give up"
        assert str(first.proc.pid) in out, out
        assert "edge-agent.lock" in out, out
        assert not second.notify.seen("READY"), "the second instance must not report ready"
        assert first.proc.poll() is None, first.output()
        assert offline_added == 0, first.listener.of("state")
        assert session_added == 0
        states = first.listener.of("state")
        assert states[-1].get("state") == "online" and states[-1].get("session") == session_before
        assert "loading" not in out.lower() and "serves its model folder" not in out
        first.signal(signal.SIGTERM)
        assert first.wait(60) == 0, first.output()
    finally:
        if second is not None:
            second.close()
        first.close()
        broker.stop()


PRECISIONS = ["fp32", "fp16", "int8"]  # RECIPE's, built in this order


@pytest.mark.parametrize(
    ("building", "status"),
    [
        ("fp32", "(1/3): fp32 reference"),  # its first progress line: the reference step's held-out samples
        ("fp16", "/fp16 (2/3)"),  # its build starts: reference, convert, compile and gate to go
        ("int8", "/int8 (3/3)"),  # the same, with calibration ahead
    ],
)
def test_sigterm_during_a_background_engine_build_exits_0_and_leaves_no_partial_entry(tmp_path, building, status):
    """SIGTERM lands once the build has said (a STATUS= line) that it is working on ``building``, with
    seconds of native work left, so the build is interrupted, never left to finish first."""
    broker = Broker(tmp_path / "broker").start()
    recipes, cache = tmp_path / "recipes", tmp_path / "engines"
    recipes.mkdir()
    (recipes / "tiny-phi3.toml").write_text(RECIPE)
    extra = f'\n[engines]\ncache_dir = "{cache}"\nrecipes_dir = "{recipes}"\nbuild_on_start = true\n'
    api_port = free_port()
    config = config_text(tmp_path / "agent", broker.port, api_port).replace('"demo-phi3"', '"demo-phi3-small"')
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port, api_port=api_port, config=config, extra=extra)
    try:
        daemon.start()
        assert daemon.proc is not None
        wait_for(
            lambda: daemon.notify.seen("STATUS", contains=status) or daemon.proc.poll() is not None,
            120,
            what=f"the background build to report '{status}'",
        )
        assert daemon.proc.poll() is None, daemon.output()
        t0 = time.monotonic()
        daemon.signal(signal.SIGTERM)
        code = daemon.wait(75)
        stop_s = time.monotonic() - t0
        out = daemon.output()
        builds = lambda: [e["data"] for e in daemon.listener.of("evt/engine_build")]  # noqa: E731
        # published before it exited; the broker may hand it to the listener a moment later
        wait_for(lambda: any(e["state"] != "started" for e in builds()), 10, what="the build's final event")
        events = builds()
        states = [e["state"] for e in events]
        statuses = [m["STATUS"] for m in daemon.notify.messages if "STATUS" in m]
        print(f"SIGTERM while building {building}: exit {code} after {stop_s:.2f} s; engine_build {states}")
        print("statuses:", statuses)
        assert "terminate called" not in out, out[-3000:]
        assert code == 0, out[-3000:]
        assert stop_s < 60, f"stopping took {stop_s:.1f} s (TimeoutStopSec=60)"
        # Interrupted, not finished: the event the fleet sees, and the line the journal shows.
        assert states == ["started", "cancelled"], events
        assert events[-1]["reason"] == "the agent is stopping", events[-1]
        earlier = PRECISIONS[: PRECISIONS.index(building)]
        assert [b["precision"] for b in events[-1]["built"]] == earlier, events[-1]
        assert f"/{building} ({PRECISIONS.index(building) + 1}/3) cancelled: the agent is stopping" in out, out[-3000:]
        # No half-written entry: every entry has its manifest and verifies; no temporary files left.
        entries = sorted((cache / "entries").iterdir()) if (cache / "entries").is_dir() else []
        for entry in entries:
            assert (entry / "manifest.json").is_file(), f"partial entry {entry}"
        assert len(entries) == len(earlier), entries  # the interrupted precision left nothing in the cache
        leftovers = [p for p in cache.rglob("*") if p.name.endswith(".tmp")]
        assert not leftovers, leftovers
        verify = subprocess.run(
            [
                str(Path(sys.executable).with_name("edge-agent")),
                "engines",
                "verify",
                "--json",
                "--config",
                str(daemon.cfg),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        daemon.close()
        broker.stop()
