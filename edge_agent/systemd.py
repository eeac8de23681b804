"""sd_notify for ``Type=notify`` services, and a watchdog that pings only while serving makes progress.

The protocol is one datagram of ``KEY=VALUE`` lines to the socket named by ``$NOTIFY_SOCKET`` (a
path, or ``@name`` for the abstract namespace). Without ``$NOTIFY_SOCKET`` (not under systemd, or in
a test) every call is a no-op, so the agent runs the same from a terminal.

    READY=1                  serving (engines loaded, API listening)
    STATUS=…                 one line shown by ``systemctl status``
    WATCHDOG=1               alive; sent every WatchdogSec/2 only while every serving loop made progress
    EXTEND_TIMEOUT_USEC=…    "still starting/stopping, give me this much more" (long engine builds)
    STOPPING=1               draining on SIGTERM
    RELOADING=1              SIGHUP: re-reading the config, with MONOTONIC_USEC (CLOCK_MONOTONIC, µs) so
                             systemd can tell this reload from an older one; READY=1 follows when done
                             (also when the new file was refused: the old config keeps serving)
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """sd_notify messages to ``$NOTIFY_SOCKET``; every call is a no-op outside systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        # WATCHDOG_PID names the process the watchdog is meant for; another process must not ping.
        self.watchdog_s: float | None = None
        if usec and usec.isdigit() and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines (``ready=1`` → ``READY=1``). False when not under systemd or on error."""
        if self.address is None:
            return False
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with self._lock, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, target)
            return True
        except OSError as exc:  # systemd gone or socket misconfigured: never fatal
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            return False

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status)

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(extend_timeout_usec=int(seconds * 1e6))

    def reloading(self, status: str = "reloading the configuration") -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(reloading=1, monotonic_usec=usec, status=status)

    def stopping(self, status: str = "draining") -> bool:
        return self.notify(stopping=1, status=status)


class Watchdog:
    """Pings ``WATCHDOG=1`` every ``WatchdogSec / 2`` while ``healthy()`` says the serving loops progress.

    ``healthy`` is the heartbeat gate: it returns True when every loop either advanced since the last
    check or had nothing to do. A wedged device thread stops the pings and systemd restarts the agent.
    """

    def __init__(self, notifier: Notifier, healthy: Callable[[], bool], interval_s: float | None = None) -> None:
        self.notifier = notifier
        self.healthy = healthy
        self.interval_s = (
            interval_s if interval_s is not None else (notifier.watchdog_s / 2 if notifier.watchdog_s else None)
        )
        self.pings = 0
        self.missed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self.interval_s and self.notifier.enabled:
            self._thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                ok = self.healthy()
            except Exception:  # a failing health check is an unhealthy agent
                log.exception("watchdog health check failed")
                ok = False
            if ok:
                self.notifier.notify(watchdog=1)
                self.pings += 1
            else:
                self.missed += 1
                log.warning("watchdog: a serving loop made no progress; not pinging systemd")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class LoopHeartbeat:
    """Heartbeat gate for one loop: healthy when its counter advanced, or it had nothing to do."""

    def __init__(self, counter: Callable[[], int], busy: Callable[[], bool]) -> None:
        self.counter, self.busy = counter, busy
        self._last = counter()

    def __call__(self) -> bool:
        now = self.counter()
        advanced = now != self._last
        self._last = now
        return advanced or not self.busy()
