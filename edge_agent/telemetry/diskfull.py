"""The spool's full-disk state: whether it is degraded, when to try the disk again, and one log
line per change of state (never one per failed write: a full disk must not flood the log too).

A try that fails doubles the wait (``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S``); the first write that
succeeds ends the state. ``low_space`` tells a full disk from a damaged file when SQLite's own error
is ambiguous (creating the ``-shm`` file on a full disk reads "disk I/O error").
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("edge_agent.telemetry.spool")

BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 8.0
MIN_FREE_BYTES = 1024 * 1024  # below this, a spool that will not open is taken for a full disk
SQLITE_FULL = 13  # sqlite3.SQLITE_FULL, which Python 3.10's sqlite3 does not define


def is_full(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "full" in str(exc).lower()


def low_space(path: Path) -> bool:
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < MIN_FREE_BYTES


class DiskFull:
    """The full-disk state of one spool: since when, why, when to try the disk again, records lost meanwhile."""

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path, self.clock = path, clock
        self.since: float | None = None
        self.error = ""
        self.retry_at = 0.0
        self.backoff = BACKOFF_MIN_S
        self.lost = 0  # records lost during this spell

    @property
    def degraded(self) -> str | None:
        return self.error if self.since is not None else None

    def may_write(self) -> bool:
        return self.since is None or self.clock() >= self.retry_at

    def failed(self, exc: BaseException) -> None:
        """A write (or opening the file) failed for lack of space."""
        now = self.clock()
        if self.since is None:
            self.since, self.backoff, self.lost = now, BACKOFF_MIN_S, 0
            self.error = f"disk full writing spool {self.path}: {exc}"
            log.error(
                "%s; telemetry degraded: windows that cannot be stored are counted as lost, retrying every %.0f-%.0f s",
                self.error,
                BACKOFF_MIN_S,
                BACKOFF_MAX_S,
            )
        elif now >= self.retry_at:  # a new try failed (not a second failure within the same try)
            self.backoff = min(BACKOFF_MAX_S, self.backoff * 2)
        else:
            return
        self.retry_at = now + self.backoff

    def wrote(self) -> None:
        if self.since is not None:
            log.warning(
                "spool %s writable again after %.1f s; %d records lost meanwhile",
                self.path,
                self.clock() - self.since,
                self.lost,
            )
            self.since = None
