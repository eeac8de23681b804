"""The command ledger: which ``cmd_id`` was seen, how it ended, and the last ``desired`` applied (its
version and the document, so that a restart can put it back in force).

SQLite (WAL, synchronous=FULL) so that a retried command after an agent restart still runs once.
Bounded: at most ``max_entries`` commands, oldest pruned first. On open, commands a previous run left
``accepted`` / ``executing`` are marked ``failed`` ("interrupted"), because whether they took effect
is unknown: a duplicate then gets that honest answer instead of a second execution.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FINAL = ("succeeded", "failed", "expired", "rejected")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS commands (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    cmd_id TEXT NOT NULL UNIQUE,
    command TEXT NOT NULL,
    status TEXT NOT NULL,
    response BLOB,
    updated_wall REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class Ledger:
    """The command ledger and the last ``desired`` applied, in SQLite (see the module doc)."""

    def __init__(self, path: Path | str, max_entries: int = 10_000, *, wall: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self._wall = wall
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = self._open()
        with self._conn:
            n = self._conn.execute(
                "UPDATE commands SET status = 'failed', response = NULL, updated_wall = ? "
                "WHERE status NOT IN ('succeeded', 'failed', 'expired', 'rejected')",
                (self._wall(),),
            ).rowcount
        if n:
            log.warning("%d commands were interrupted by the last shutdown; duplicates will be told so", n)

    def _open(self) -> sqlite3.Connection:
        try:
            conn = self._connect()
            if conn.execute("PRAGMA quick_check").fetchone()[0] == "ok":
                return conn
            conn.close()
            problem = "integrity check failed"
        except sqlite3.DatabaseError as exc:
            problem = str(exc)
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(self._wall())}")
        for suffix in ("", "-wal", "-shm"):
            if Path(str(self.path) + suffix).exists():
                os.replace(str(self.path) + suffix, str(aside) + suffix)
        log.error(
            "command ledger %s was damaged (%s); moved to %s and started empty: a command retried now may run again",
            self.path,
            problem,
            aside,
        )
        return self._connect()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_SCHEMA)
        return conn

    def lookup(self, cmd_id: str) -> tuple[str, str, bytes | None] | None:
        """(command, status, last response) for a known ``cmd_id``."""
        with self._lock:
            row = self._conn.execute(
                "SELECT command, status, response FROM commands WHERE cmd_id = ?", (cmd_id,)
            ).fetchone()
        return None if row is None else (row[0], row[1], None if row[2] is None else bytes(row[2]))

    def record(self, cmd_id: str, command: str, status: str, response: bytes | None) -> None:
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO commands(cmd_id, command, status, response, updated_wall) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(cmd_id) DO UPDATE SET status = excluded.status, response = excluded.response, "
                "updated_wall = excluded.updated_wall",
                (cmd_id, command, status, response, self._wall()),
            )
            self._conn.execute("DELETE FROM commands WHERE n <= (SELECT MAX(n) FROM commands) - ?", (self.max_entries,))

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, key: str, value: str) -> None:
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO kv(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def put_many(self, values: dict[str, str]) -> None:
        """Several keys in one transaction: a crash keeps all of them or none."""
        with self._lock, self._conn:
            self._conn.executemany(
                "INSERT INTO kv(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                list(values.items()),
            )

    def delete(self, *keys: str) -> None:
        with self._lock, self._conn:
            self._conn.executemany("DELETE FROM kv WHERE key = ?", [(k,) for k in keys])

    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM commands").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
