"""`edge-agent run` as a subprocess against a real mosquitto, with a test-owned NOTIFY_SOCKET.

READY=1 and watchdog pings; telemetry on the documented topics, valid against the checked-in JSON
Schemas; the OpenAI client through the local API; SIGHUP with a broken config keeps serving; SIGTERM
drains an in-flight streamed request; kill -9 and restart increments the session."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from tests.daemon_proc import Listener, Notify, config_text, start_agent, stop
from tests.mqtt_broker import Broker, free_port, wait_for

paho = pytest.importorskip("paho.mqtt.client")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = Path(__file__).resolve().parents[2] / "edge_agent" / "telemetry" / "schemas"
DEVICE = "dev-e2e"


def validate(kind: str, payload: dict) -> None:
    jsonschema.validate(payload, json.loads((SCHEMAS / f"{kind}.json").read_text()))


@pytest.mark.slow
def test_daemon_lifecycle(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    api_port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(config_text(tmp_path, broker.port, api_port))
    notify = Notify(tmp_path / "notify.sock")
    listener = Listener(broker.port)
    proc = start_agent(cfg, notify)
    try:
        wait_for(lambda: notify.seen("READY", "1") or proc.poll() is not None, 120, what="READY=1")
        assert proc.poll() is None, stop(proc)
        assert notify.seen("STATUS", contains="serving")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            out = client.chat.completions.create(
                model="small", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
            )
            assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        wait_for(lambda: notify.seen("WATCHDOG", "1"), 10, what="a watchdog ping")

        # Telemetry on the documented topics, valid against the checked-in schemas.
        wait_for(
            lambda: any(w.get("counts") or w.get("series") for w in listener.of("tele/latency")),
            30,
            what="a latency window",
        )
        state = listener.of("state")
        assert state and state[0]["state"] == "online"
        validate("state", state[0])
        validate("meta", listener.of("meta")[0])
        validate("reported", listener.of("reported")[-1])
        assert listener.of("reported")[-1]["active_tiers"]["llm"] == "small"
        for window in listener.of("tele/latency"):
            validate("tele_latency", window)
        session = state[0]["session"]

        # SIGHUP with a broken file: refused, still serving.
        cfg.write_text(config_text(tmp_path, broker.port, api_port).replace("target_ms = 387", "target_ms = -5"))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: notify.seen("STATUS", contains="reload refused"), 20, what="reload refused")
        assert client.completions.create(model="small", prompt="Still", max_tokens=3).choices[0].text is not None
        cfg.write_text(config_text(tmp_path, broker.port, api_port, target_ms=250))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: notify.seen("STATUS", contains="reloaded"), 20, what="reloaded")

        # SIGTERM while a streamed request is in flight: it finishes, then the agent says offline.
        pieces: list[str] = []
        finish: list[str] = []

        def stream() -> None:
            for chunk in client.chat.completions.create(
                model="small",
                stream=True,
                max_tokens=48,
                temperature=0,
                messages=[{"role": "user", "content": "Tell a story"}],
            ):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    if chunk.choices[0].finish_reason:
                        finish.append(chunk.choices[0].finish_reason)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_for(lambda: len(pieces) >= 2, 30, what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert finish and finish[0] in ("length", "stop"), "the in-flight request was dropped"
        assert proc.wait(60) == 0
        assert notify.seen("STOPPING", "1")
        wait_for(lambda: listener.of("state")[-1]["state"] == "offline", 10, what="offline state")

        # kill -9 and restart: a new session. (Each reload above also ended with READY=1: count from here.)
        readies = notify.count("READY", "1")
        proc = start_agent(cfg, notify)
        wait_for(lambda: notify.count("READY", "1") >= readies + 1, 120, what="second start's READY")
        proc.kill()
        proc.wait(10)
        proc = start_agent(cfg, notify)
        wait_for(lambda: notify.count("READY", "1") >= readies + 2, 120, what="third start's READY")
        wait_for(lambda: listener.of("state")[-1]["state"] == "online", 20, what="online again")
        assert listener.of("state")[-1]["session"] >= session + 2
    finally:
        output = stop(proc)
        listener.close()
        notify.close()
        broker.stop()
    assert "Traceback" not in output, output
