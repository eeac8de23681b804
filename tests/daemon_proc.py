"""`edge-agent run` as a subprocess, for end-to-end and fault tests.

    daemon = Daemon(tmp_path, broker_port=broker.port).start()   # writes agent.toml, waits for READY=1
    daemon.url("/health"); daemon.notify.seen("WATCHDOG", "1"); daemon.listener.of("state")
    daemon.signal(signal.SIGTERM); daemon.wait(60); out = daemon.output()

The config is the e2e one (a single small demo-phi3 tier, no ASR, 1 s telemetry windows) unless
``config`` is given; ``extra`` is TOML appended to it. The daemon's stdout/stderr are collected on a
thread, so a chatty daemon never blocks on a full pipe. Only processes started here are signalled;
every wait is bounded.
"""

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

from tests.mqtt_broker import free_port, wait_for

__all__ = ["Daemon", "Listener", "Notify", "config_text", "free_port", "wait_for"]


def config_text(tmp: Path, mqtt_port: int, api_port: int, target_ms: float = 387, device: str = "dev-e2e") -> str:
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
device_id = "{device}"

[telemetry]
interval_s = 1
spool_path = "{tmp / "spool.sqlite"}"
ledger_path = "{tmp / "ledger.sqlite"}"

[api]
host = "127.0.0.1"
port = {api_port}

[sla]
target_ms = {target_ms}
evaluate_every_s = 1
"""


class Notify:
    """A test-owned ``NOTIFY_SOCKET``: every datagram the daemon sends, parsed into dicts."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.messages: list[dict[str, str]] = []
        self.times: list[float] = []  # monotonic arrival time of each message
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
            self.times.append(time.monotonic())

    def seen(self, key: str, value: str | None = None, contains: str | None = None) -> bool:
        return any(
            key in m and (value is None or m[key] == value) and (contains is None or contains in m[key])
            for m in self.messages
        )

    def count(self, key: str, value: str | None = None) -> int:
        return sum(1 for m in self.messages if key in m and (value is None or m[key] == value))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class Listener:
    """An MQTT 5 client subscribed to everything under one device's prefix."""

    def __init__(self, port: int, device: str = "dev-e2e", client_id: str | None = None) -> None:
        import paho.mqtt.client as paho

        self.device = device
        self.messages: list[tuple[str, dict, bool]] = []
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=client_id or f"listener-{device}", protocol=paho.MQTTv5
        )
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, u, f, rc, p=None: c.subscribe(f"edge/v1/{device}/#", qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        try:
            payload = json.loads(message.payload)
        except ValueError:
            payload = {"_raw": message.payload.decode(errors="replace")}
        self.messages.append((message.topic, payload, message.retain))

    def of(self, suffix: str) -> list[dict]:
        return [p for t, p, _ in self.messages if t == f"edge/v1/{self.device}/{suffix}"]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def start_agent(cfg: Path, notify: Notify, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    full_env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000", **(env or {})}
    full_env.pop("WATCHDOG_PID", None)
    exe = Path(sys.executable).with_name("edge-agent")
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    return subprocess.Popen([str(exe), "run", "--config", str(cfg)], env=full_env, text=True, **popen)


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


class Daemon:
    """One ``edge-agent run`` process with its own config, notify socket and (optional) MQTT listener."""

    def __init__(
        self,
        workdir: Path,
        broker_port: int,
        config: str | None = None,
        extra: str = "",
        device: str = "dev-e2e",
        env: dict[str, str] | None = None,
        api_port: int | None = None,
        listen: bool = True,
        name: str = "agent",
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_port = api_port or free_port()
        self.broker_port, self.device, self.env = broker_port, device, env or {}
        self.cfg = self.workdir / f"{name}.toml"
        self.cfg.write_text((config or config_text(self.workdir, broker_port, self.api_port, device=device)) + extra)
        self.notify = Notify(self.workdir / f"{name}-notify.sock")
        self.listener = Listener(broker_port, device, client_id=f"listener-{name}-{os.getpid()}") if listen else None
        self.proc: subprocess.Popen | None = None
        self._out: list[str] = []
        self._reader: threading.Thread | None = None

    def start(self, wait_ready: bool = True, timeout_s: float = 120) -> Daemon:
        self.proc = start_agent(self.cfg, self.notify, self.env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait_ready:
            wait_for(lambda: self.notify.seen("READY", "1") or self.proc.poll() is not None, timeout_s, what="READY=1")
            assert self.proc.poll() is None, f"the daemon exited {self.proc.returncode}:\n{self.output()}"
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.append(line)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.api_port}{path}"

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout_s)
        if self._reader is not None:
            self._reader.join(5)
        return code

    def output(self) -> str:
        return "".join(self._out)

    def close(self) -> str:
        """Kill the process if it still runs; close the socket and listener; return everything it printed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self._reader is not None:
            self._reader.join(5)
        if self.listener is not None:
            self.listener.close()
        self.notify.close()
        return self.output()


def speech_daemon(tmp: Path, broker_port: int, max_new_tokens: int = 48) -> Daemon:
    """A ``Daemon`` (not started) serving the test LLM tier (``max_new_tokens`` per reply) and the demo-asr
    tier, its cache and state under ``tmp``."""
    api_port = free_port()
    cfg = config_text(tmp, broker_port, api_port).replace("asr = []\n", "")
    cfg = cfg.replace("max_new_tokens = 48", f"max_new_tokens = {max_new_tokens}")
    cfg += '\n[[models.asr]]\nname = "ctc"\nmodel = "demo-asr"\n'
    env = {"CACHE_DIRECTORY": str(tmp / "cache"), "STATE_DIRECTORY": str(tmp / "state")}
    return Daemon(tmp, broker_port=broker_port, config=cfg, api_port=api_port, env=env)
