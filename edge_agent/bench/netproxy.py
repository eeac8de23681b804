"""A loopback TCP proxy that can cut, blackhole or delay a link: network faults without root or tc.

Used by ``edge-agent bench telemetry`` (a slow broker) and by the telemetry fault tests.

    proxy = TcpProxy(target_port).start()   # clients connect to proxy.port
    proxy.cut() / proxy.blackhole() / proxy.delay(0.2) / proxy.heal() / proxy.stop()
"""

from __future__ import annotations

import select
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """Loopback TCP proxy: pass, ``cut`` (reset every connection and refuse new ones), ``blackhole``
    (keep connections open but forward nothing), ``delay`` (forward each chunk after a pause)."""

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self.mode = "pass"
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self.accepted = 0

    def start(self) -> TcpProxy:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        srv.settimeout(0.1)
        self._server = srv
        t = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            if self.mode == "cut":
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                _reset(client)
                continue
            self.accepted += 1
            with self._lock:
                self._conns.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), name="proxy-pipe", daemon=True)
                t.start()
            self._threads = [t for t in self._threads if t.is_alive()]

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.1)
                if not ready:
                    continue
                if self.mode == "blackhole":
                    # Leave the bytes in the kernel buffer: the peer sees a silent, open connection.
                    time.sleep(0.05)
                    continue
                data = src.recv(65536)
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                if self.mode == "cut":
                    break
                dst.sendall(data)
        except (OSError, ValueError):  # closed under us by cut()
            pass
        finally:
            for s in (src, dst):
                _close(s)

    def cut(self) -> None:
        """Reset every open connection and refuse new ones until ``heal``."""
        self.mode = "cut"
        with self._lock:
            conns, self._conns = self._conns, []
        for a, b in conns:
            _reset(a)
            _reset(b)

    def blackhole(self) -> None:
        self.mode = "blackhole"

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def heal(self) -> None:
        self.mode = "pass"
        self.delay_s = 0.0

    def stop(self) -> None:
        self.cut()
        self._stop.set()
        if self._server:
            self._server.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass
