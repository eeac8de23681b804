"""One daemon per state: an exclusive lock on ``<state dir>/edge-agent.lock`` before anything else.

Two ``edge-agent run`` processes on the same spool and ledger would share one device identity: the
same MQTT client id (the broker kicks each off when the other connects, and each kick publishes the
retained ``offline`` Will), one session counter, one SQLite spool. So ``run`` first locks every
distinct folder holding its state (``telemetry.spool_path`` with its ``.seq`` sidecar, and
``telemetry.ledger_path``) with ``flock``; the holder writes its PID into the file. A second
instance finds the lock taken and exits at once, naming the holder's PID and the lock file, before
it connects to anything or loads a model.

``flock`` locks belong to the open file: the kernel drops them when the process dies, kill -9
included, so a crash never leaves a stale lock behind (the PID left in the file is only read while
someone holds the lock).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EdgeAgentError

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger(__name__)

LOCK_NAME = "edge-agent.lock"


class AlreadyRunning(EdgeAgentError):
    """Another process holds the state lock; ``pid`` is its PID (None when it has not written it yet)."""

    def __init__(self, message: str, path: Path, pid: int | None) -> None:
        super().__init__(message)
        self.path, self.pid = path, pid


def state_dirs(settings: Settings) -> list[Path]:
    """The distinct folders holding this agent's state (the ``seq`` sidecar sits beside the spool)."""
    t = settings.telemetry
    folders = {Path(p).expanduser().absolute().parent for p in (t.spool_path, t.ledger_path)}
    return sorted(folders)


def read_holder(path: Path, wait_s: float = 1.0) -> int | None:
    """The PID written in the lock file ``path``; waits up to ``wait_s`` for a holder that has just
    taken the lock and not written it yet."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


class StateLock:
    """Exclusive, non-blocking ``flock`` on ``edge-agent.lock`` in each of ``folders``."""

    def __init__(self, folders: Iterable[Path]) -> None:
        self.folders = sorted({Path(f) for f in folders})  # one order for everyone: no lock-order deadlock
        self._fds: list[int] = []

    @property
    def paths(self) -> list[Path]:
        return [f / LOCK_NAME for f in self.folders]

    def acquire(self) -> StateLock:
        try:
            for path in self.paths:
                self._fds.append(self._lock(path))
        except BaseException:
            self.release()
            raise
        log.debug("state lock held: %s", ", ".join(str(p) for p in self.paths))
        return self

    def _lock(self, path: Path) -> int:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise EdgeAgentError(f"cannot open the state lock {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = read_holder(path)
            who = f"PID {pid}" if pid is not None else "a process that has not written its PID yet"
            raise AlreadyRunning(
                f"another edge-agent ({who}) is running on this device's state: {path} is locked. Stop it first "
                "(systemctl stop edge-agent), or give this instance its own telemetry.spool_path and "
                "telemetry.ledger_path",
                path,
                pid,
            ) from None
        except OSError as exc:
            os.close(fd)
            raise EdgeAgentError(f"cannot lock {path}: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        """Drop the locks (the kernel does it anyway when the process exits)."""
        while self._fds:
            fd = self._fds.pop()
            try:
                os.ftruncate(fd, 0)  # while still locked: no newer holder's PID is erased
            except OSError:
                pass
            os.close(fd)

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
