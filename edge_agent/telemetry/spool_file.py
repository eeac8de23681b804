"""The spool's SQLite file: opening it, moving a damaged one aside with its readable records salvaged,
and a start on a full disk (the file left untouched until space returns).

``SpoolFile`` is the base of ``Spool`` (see ``spool``'s module doc for the semantics): it owns the
connection, the ``seq`` counters' sidecar and the totals; ``Spool`` adds writing, bounds and acks.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from . import seq as seqmod
from .diskfull import DiskFull, is_full, low_space
from .drops import Drops
from .salvage import salvage

# The spool's logger, so that its damage and full-disk lines read as one component's.
log = logging.getLogger("edge_agent.telemetry.spool")

RECORD_OVERHEAD = 64  # bytes counted per record besides payload and topic (row header, index)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    topic TEXT NOT NULL,
    seq INTEGER NOT NULL,
    session INTEGER NOT NULL,
    created_wall REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    crc INTEGER NOT NULL,
    payload BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS records_kind ON records(kind, id);
"""


class SpoolFile:
    """The spool's file and connection: open, recover from damage, attach after a start on a full disk."""

    path: Path
    session: int
    records: int
    bytes: int
    corrupt_records: int
    recovered_from: Path | None
    _wall: Callable[[], float]
    _lock: threading.RLock
    _drops: Drops
    _sidecar: seqmod.Sidecar
    _full: DiskFull
    _conn: sqlite3.Connection
    _attached: bool

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level="DEFERRED", check_same_thread=False, timeout=10)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_SCHEMA)
        return conn

    def _open(self) -> sqlite3.Connection:
        problem = None
        if self.path.exists():
            try:
                conn = self._connect()
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                if check == "ok":
                    return conn
                problem = f"integrity check failed: {check}"
                conn.close()
            except sqlite3.DatabaseError as exc:
                problem = str(exc)
        if problem is None:
            return self._connect()
        if low_space(self.path):  # not damage: moving a healthy spool aside would lose it
            raise sqlite3.OperationalError(f"database or disk is full ({problem})")
        return self._recover(problem)

    def _detached(self, exc: sqlite3.Error) -> sqlite3.Connection:
        """Started on a full disk: the file stays as it is, untouched, and records cannot be stored
        (windows are lost and reported, like any record on a full disk) until ``_attach`` opens it.
        The counters live in memory meanwhile, above the sidecar and the file's last readable ones."""
        self._attached = False
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        conn.executescript(_SCHEMA)
        floors = self._sidecar.read()
        try:  # the main file without its WAL: read only, needs no space
            ro = sqlite3.connect(f"file:{self.path}?immutable=1", uri=True)
            try:
                for key, value in seqmod.read_all(ro).items():
                    floors[key] = max(value, floors.get(key, 0))
            finally:
                ro.close()
        except sqlite3.Error:
            pass
        with conn:
            seqmod.raise_floor(conn, floors)
            self.session = seqmod.allocate(conn, seqmod.SESSION)
        self._full.failed(exc)
        return conn

    def _attach(self) -> bool:
        """Open the file after a start on a full disk; its counters rise to those handed out since."""
        try:
            conn = self._open()
            with conn:
                seqmod.raise_floor(conn, seqmod.read_all(self._conn))
        except sqlite3.Error as exc:
            if not (is_full(exc) or low_space(self.path)):
                raise
            self._full.failed(exc)
            return False
        self._conn.close()
        self._conn, self._attached = conn, True
        self.records, self.bytes = self._totals()
        return True

    def _recover(self, problem: str) -> sqlite3.Connection:
        salvaged, counters, bad, bad_windows = salvage(self.path)
        self.corrupt_records += bad
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(self._wall())}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                os.replace(src, Path(str(aside) + suffix))
        self.recovered_from = aside
        floors = self._sidecar.recovery_floors(counters)
        detail = (
            f"spool {self.path} was damaged ({problem}); moved to {aside}; "
            f"{len(salvaged)} readable records salvaged, {bad} corrupt; seq continues after "
            f"{floors.get('tele', 0)}"
        )
        newest = max((row[2] for row in salvaged if row[0] == "window"), default=0)
        if floors.get("tele", 0) > newest:  # delivered before the damage, or lost with it: unknowable
            detail += f"; windows {newest + 1}-{floors['tele']} were not in it (acknowledged, or lost with the damage)"
        log.error("%s", detail)
        conn = self._connect()
        with conn:
            seqmod.raise_floor(conn, floors)
            for row in salvaged:
                conn.execute(
                    "INSERT INTO records(kind, topic, seq, session, created_wall, attempts, crc, payload) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    row,
                )
        self._drops.note("corrupt", detail)
        for seq in bad_windows:
            self._drops.add("corrupt", "window", seq, 0)
        return conn

    def _totals(self) -> tuple[int, int]:
        with self._lock:
            n, size = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload) + LENGTH(topic)), 0) FROM records"
            ).fetchone()
        return int(n), int(size) + RECORD_OVERHEAD * int(n)

    def _mirror(self) -> None:
        self._sidecar.write(seqmod.read_all(self._conn))
