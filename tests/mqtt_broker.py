"""A real mosquitto for tests, on 127.0.0.1 and a free port, plus a loopback TCP proxy for faults
(``TcpProxy``, from ``edge_agent.bench.netproxy``, which the telemetry benchmark uses too).

    broker = Broker(tmp_path).start()          # optional: tls=Certs(...), passwords={...}, acl="..."
    proxy = TcpProxy(broker.port).start()      # clients connect to proxy.port
    proxy.cut() / proxy.blackhole() / proxy.delay(0.2) / proxy.heal()
    broker.restart() / broker.kill() / broker.start()   # same port every time

Only processes this module started are ever signalled. Every wait is bounded.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from edge_agent.bench.netproxy import TcpProxy, free_port

__all__ = ["Broker", "Certs", "TcpProxy", "free_port", "wait_for", "wait_port"]

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s} s")


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass
class Certs:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate (CN = device id)."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def generate(cls, directory: Path, client_cn: str = "dev-tls") -> Certs:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)

        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

        ssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=edge-test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        )
        (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for name, cn, ext in (("server", "localhost", True), ("client", client_cn, False)):
            ssl(
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                f"/CN={cn}",
                "-keyout",
                f"{name}.key",
                "-out",
                f"{name}.csr",
            )
            extra = ["-extfile", "san.ext"] if ext else []
            ssl(
                "x509",
                "-req",
                "-in",
                f"{name}.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                f"{name}.pem",
                *extra,
            )
        return cls(d, d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


class Broker:
    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        tls: Certs | None = None,
        require_client_cert: bool = False,
        passwords: dict[str, str] | None = None,
        acl: str | None = None,
        max_packet_size: int | None = None,
        persistence: bool = False,
    ) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "mosquitto.log"
        # Started as root, mosquitto would drop to the "mosquitto" user and could not read our files.
        run_as = [f"user {pwd.getpwuid(os.geteuid()).pw_name}"] if os.geteuid() == 0 else []
        lines = [
            *run_as,
            f"listener {self.port} 127.0.0.1",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "max_queued_messages 100000",
        ]
        if persistence:  # sessions and queued messages survive a graceful restart
            lines += ["persistence true", f"persistence_location {self.dir}/", "autosave_interval 1"]
        else:
            lines.append("persistence false")
        if max_packet_size:
            lines.append(f"max_packet_size {max_packet_size}")
        if tls:
            lines += [
                f"cafile {tls.ca}",
                f"certfile {tls.server_cert}",
                f"keyfile {tls.server_key}",
                "tls_version tlsv1.2",
            ]
            if require_client_cert:
                lines += ["require_certificate true", "use_identity_as_username true"]
        if passwords:
            pw = self.dir / "passwd"
            pw.write_text("")
            for user, secret in passwords.items():
                subprocess.run(
                    ["mosquitto_passwd", "-b", str(pw), user, secret], check=True, capture_output=True, timeout=30
                )
            os.chmod(pw, 0o600)
            lines += [f"password_file {pw}", "allow_anonymous false"]
        elif not (tls and require_client_cert):
            lines.append("allow_anonymous true")
        if acl is not None:
            path = self.dir / "acl"
            path.write_text(acl)
            os.chmod(path, 0o600)
            lines.append(f"acl_file {path}")
        self.conf = self.dir / "mosquitto.conf"
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 15.0) -> Broker:
        if self.proc and self.proc.poll() is None:
            return self
        if not os.path.exists(MOSQUITTO):
            raise RuntimeError(
                f"{MOSQUITTO} not found: the telemetry tests need a real broker "
                "(apt install mosquitto mosquitto-clients; scripts/setup does it)"
            )
        deadline = time.monotonic() + timeout_s
        while True:  # the port may linger briefly after a kill
            self.proc = subprocess.Popen(
                [MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            try:
                wait_port(self.port, timeout_s=min(5.0, max(0.5, deadline - time.monotonic())))
                return self
            except TimeoutError:
                err = self._reap()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mosquitto did not start on port {self.port}: {err}") from None
                time.sleep(0.2)

    def _reap(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            _out, err = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            err = b""
        return (err or b"").decode(errors="replace")[-2000:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful: SIGTERM (mosquitto disconnects clients cleanly and exits)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no goodbye to any client; sockets are reset by the kernel."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
