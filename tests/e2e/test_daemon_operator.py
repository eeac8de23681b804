"""Operator comfort, from outside: ``edge-agent run`` with ``[logging] format = "json"`` prints one JSON
object per line, starting with a summary (version, config file, device id and where it came from,
tiers, runtimes); SIGHUP is a ``Type=notify`` reload (``RELOADING=1`` + ``MONOTONIC_USEC``, then
``READY=1`` with the outcome, also when the new file is refused)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.daemon_proc import Daemon, config_text, wait_for
from tests.mqtt_broker import Broker

pytest.importorskip("paho.mqtt.client")


def reload_once(daemon: Daemon) -> tuple[dict, dict]:
    """SIGHUP; the RELOADING=1 message and the READY=1 that follows it."""
    start = len(daemon.notify.messages)
    sent_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    daemon.signal(signal.SIGHUP)
    wait_for(
        lambda: any(m.get("READY") == "1" for m in daemon.notify.messages[start:]), 20, what="READY=1 after reload"
    )
    after = daemon.notify.messages[start:]
    reloading = [i for i, m in enumerate(after) if m.get("RELOADING") == "1"]
    ready = [i for i, m in enumerate(after) if m.get("READY") == "1"]
    assert reloading and reloading[0] < ready[0], after
    first = after[reloading[0]]
    assert int(first["MONOTONIC_USEC"]) >= sent_usec  # CLOCK_MONOTONIC, microseconds, taken after our signal
    assert int(first["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return first, after[ready[0]]


def test_json_logs_startup_summary_and_notify_reload(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port, extra='\n[logging]\nformat = "json"\n')
    try:
        daemon.start()
        _, ready = reload_once(daemon)
        assert ready["STATUS"].startswith("reloaded"), ready

        broken = config_text(daemon.workdir, broker.port, daemon.api_port).replace("target_ms = 387", "target_ms = -5")
        daemon.cfg.write_text(broken + '\n[logging]\nformat = "json"\n')
        _, ready = reload_once(daemon)
        assert ready["STATUS"].startswith("reload refused"), ready
        assert "sla.target_ms" in ready["STATUS"]

        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
        out = daemon.output()
    finally:
        out = daemon.close()
        broker.stop()

    records = []
    for line in out.splitlines():
        if line.strip():
            record = json.loads(line)  # every line is one JSON object
            assert {"time", "level", "logger", "message"} <= set(record), line
            records.append(record)
    messages = [r["message"] for r in records]
    assert messages[0].startswith("edge-agent ") and "starting" in messages[0]
    assert f"config: {daemon.cfg}" in messages
    assert f"device id: dev-e2e (from {daemon.cfg} [mqtt] device_id)" in messages
    assert "llm tiers: small (demo-phi3, onnxruntime/cpu, auto)" in messages
    assert "asr tiers: (none)" in messages
    assert any(m.startswith("backends: onnxruntime ") and "not installed" not in m for m in messages)
    assert any(r["level"] == "ERROR" and "reload refused" in r["message"] for r in records)


def test_device_id_from_the_environment_is_named_as_such(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    text = config_text(tmp_path / "agent", broker.port, 0).replace('device_id = "dev-e2e"\n', "")
    daemon = Daemon(
        tmp_path / "agent",
        broker_port=broker.port,
        config=text,
        device="dev-env",
        env={"EDGE_AGENT_MQTT__DEVICE_ID": "dev-env", "EDGE_AGENT_API__PORT": "0"},
    )
    try:
        daemon.start()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        out = daemon.close()
        broker.stop()
    assert "config: " + str(daemon.cfg) + " + environment EDGE_AGENT_API__PORT, EDGE_AGENT_MQTT__DEVICE_ID" in out
    assert "device id: dev-env (from environment EDGE_AGENT_MQTT__DEVICE_ID)" in out
