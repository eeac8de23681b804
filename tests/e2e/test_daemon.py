"""`edge-agent run` as a subprocess against a real mosquitto, with a test-owned NOTIFY_SOCKET.

READY=1 and watchdog pings; telemetry on the documented topics, valid against the checked-in JSON
Schemas; the OpenAI client through the local API; SIGHUP with a broken config keeps serving; SIGTERM
drains an in-flight streamed request; kill -9 and restart increments the session."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.mqtt_broker import Broker, free_port, wait_for

paho = pytest.importorskip("paho.mqtt.client")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = Path(__file__).resolve().parents[2] / "edge_agent" / "telemetry" / "schemas"
DEVICE = "dev-e2e"


def config_text(tmp: Path, mqtt_port: int, api_port: int, target_ms: float = 387) -> str:
    return f"""
[models]
asr = []
[[models.llm]]
name = "small"
model = "demo-phi3"
max_new_tokens = 48
max_batch = 2

[mqtt]
host = "127.0.0.1"
port = {mqtt_port}
device_id = "{DEVICE}"

[telemetry]
interval_s = 1
spool_path = "{tmp / 'spool.sqlite'}"
ledger_path = "{tmp / 'ledger.sqlite'}"

[api]
host = "127.0.0.1"
port = {api_port}

[sla]
target_ms = {target_ms}
evaluate_every_s = 1
"""


class Notify:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))

    def seen(self, key: str, value: str | None = None, contains: str | None = None) -> bool:
        return any(key in m and (value is None or m[key] == value) and (contains is None or contains in m[key])
                   for m in self.messages)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class Listener:
    def __init__(self, port: int) -> None:
        self.messages: list[tuple[str, dict, bool]] = []
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="e2e-listener",
                                  protocol=paho.MQTTv5)
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, json.loads(m.payload), m.retain))
        self.client.on_connect = lambda c, u, f, rc, p=None: c.subscribe(f"edge/v1/{DEVICE}/#", qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def of(self, suffix: str) -> list[dict]:
        return [p for t, p, _ in self.messages if t == f"edge/v1/{DEVICE}/{suffix}"]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def validate(kind: str, payload: dict) -> None:
    jsonschema.validate(payload, json.loads((SCHEMAS / f"{kind}.json").read_text()))


def start_agent(cfg: Path, notify: Notify) -> subprocess.Popen:
    env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    env.pop("WATCHDOG_PID", None)
    exe = Path(sys.executable).with_name("edge-agent")
    return subprocess.Popen([str(exe), "run", "--config", str(cfg)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


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
            out = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, temperature=0)
            assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        wait_for(lambda: notify.seen("WATCHDOG", "1"), 10, what="a watchdog ping")

        # Telemetry on the documented topics, valid against the checked-in schemas.
        wait_for(lambda: any(w.get("counts") or w.get("series") for w in listener.of("tele/latency")), 30,
                 what="a latency window")
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
            for chunk in client.chat.completions.create(model="small", stream=True, max_tokens=48, temperature=0,
                                                        messages=[{"role": "user", "content": "Tell a story"}]):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    if chunk.choices[0].finish_reason:
                        finish.append(chunk.choices[0].finish_reason)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: len(pieces) >= 2, 30, what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert finish and finish[0] in ("length", "stop"), "the in-flight request was dropped"
        assert proc.wait(60) == 0
        assert notify.seen("STOPPING", "1")
        wait_for(lambda: listener.of("state")[-1]["state"] == "offline", 10, what="offline state")

        # kill -9 and restart: a new session.
        proc = start_agent(cfg, notify)
        wait_for(lambda: sum(1 for m in notify.messages if m.get("READY") == "1") >= 2, 120, what="second READY")
        proc.kill()
        proc.wait(10)
        proc = start_agent(cfg, notify)
        wait_for(lambda: sum(1 for m in notify.messages if m.get("READY") == "1") >= 3, 120, what="third READY")
        wait_for(lambda: listener.of("state")[-1]["state"] == "online", 20, what="online again")
        assert listener.of("state")[-1]["session"] >= session + 2
    finally:
        output = stop(proc)
        listener.close()
        notify.close()
        broker.stop()
    assert "Traceback" not in output, output
