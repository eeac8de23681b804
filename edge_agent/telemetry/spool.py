"""Store-and-forward spool: every outgoing window and event is written here before it is published.

SQLite in WAL mode with ``synchronous=FULL``: a record that ``append`` returned survives kill -9
and power loss. A record is deleted only when the broker acknowledged it with a reason code below
0x80 (``ack``); a refusal (``reject``) is retried and dropped, reported, after ``max_attempts``.

Bounds: ``max_bytes`` (payload + topic bytes) and ``max_records``. When either is exceeded the
oldest *windows* go first, then the oldest events; every loss is queued as a ``SpoolDrop`` report
(``take_drops``) that the publisher turns into a ``spool_drop`` event, with the ``seq`` ranges lost.

Damage never stops the agent:
- each record carries a CRC32 of its payload; a mismatch is skipped, deleted, counted and reported;
- a file SQLite cannot read (truncated, overwritten, not a database) is moved aside to
  ``<path>.corrupt-<unix time>``, the readable records are salvaged into a fresh file, and the
  event says where the damaged file went;
- a full disk (SQLITE_FULL) drops the oldest windows and retries once; if it still fails the
  record is counted as lost and reported (reason ``disk_full``).

Single writer: the telemetry thread. A lock guards the connection anyway.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from . import seq as seqmod
from .salvage import STREAM_OF, salvage
from .schema import SpoolDrop

log = logging.getLogger(__name__)

Kind = Literal["window", "event"]
RECORD_OVERHEAD = 64  # bytes counted per record besides payload and topic (row header, index)
MAX_RANGES = 32

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


@dataclass(frozen=True, slots=True)
class Record:
    id: int
    kind: Kind
    topic: str
    seq: int
    session: int
    created_wall: float
    attempts: int
    payload: bytes

    @property
    def size(self) -> int:
        return len(self.payload) + len(self.topic) + RECORD_OVERHEAD


class _Drops:
    """Losses since the last report, per reason."""

    def __init__(self) -> None:
        self.by_reason: dict[str, dict] = {}

    def add(self, reason: str, kind: str, seq: int, size: int, detail: str | None = None) -> None:
        d = self.by_reason.setdefault(reason, {"windows": 0, "events": 0, "bytes": 0, "seqs": [], "detail": None})
        d["windows" if kind == "window" else "events"] += 1
        d["bytes"] += size
        if kind == "window" and seq > 0:
            d["seqs"].append(seq)
        if detail:
            d["detail"] = detail

    def note(self, reason: str, detail: str) -> None:
        self.by_reason.setdefault(reason, {"windows": 0, "events": 0, "bytes": 0, "seqs": [], "detail": None})
        self.by_reason[reason]["detail"] = detail

    def take(self) -> list[SpoolDrop]:
        out = [SpoolDrop(reason=reason, windows=d["windows"], events=d["events"], bytes=d["bytes"],
                         seq_ranges=_ranges(d["seqs"]), detail=(d["detail"] or None) and d["detail"][:1024])
               for reason, d in sorted(self.by_reason.items())]
        self.by_reason = {}
        return out


def _ranges(values: list[int]) -> list[tuple[int, int]]:
    ranges: list[list[int]] = []
    for v in sorted(set(values)):
        if ranges and v == ranges[-1][1] + 1:
            ranges[-1][1] = v
        else:
            ranges.append([v, v])
    if len(ranges) > MAX_RANGES:  # keep the message bounded: fold the middle into one range
        ranges = ranges[: MAX_RANGES // 2] + [[ranges[MAX_RANGES // 2][0], ranges[-MAX_RANGES // 2][1]]] \
            + ranges[-MAX_RANGES // 2 + 1:]
    return [(a, b) for a, b in ranges]


def _is_full(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc).lower()


class Spool:
    def __init__(self, path: Path | str, max_bytes: int = 64 * 1024 * 1024, max_records: int = 100_000,
                 max_attempts: int = 5, *, wall: Callable[[], float] = time.time) -> None:
        if max_bytes < 4096 or max_records < 2:
            raise ValueError("spool bounds too small: max_bytes >= 4096 and max_records >= 2")
        self.path = Path(path)
        self.max_bytes, self.max_records, self.max_attempts = max_bytes, max_records, max_attempts
        self._wall = wall
        self._lock = threading.RLock()
        self._drops = _Drops()
        self._sidecar = seqmod.Sidecar(self.path)
        self.corrupt_records = 0  # CRC mismatches or unreadable rows, since open
        self.write_errors = 0  # appends that failed even after making room
        self.recovered_from: Path | None = None  # where a damaged file was moved, if it was
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = self._open()
        with self._lock, self._conn:
            self.session = seqmod.allocate(self._conn, seqmod.SESSION)
        self._mirror()
        self.records, self.bytes = self._totals()

    # -- opening and recovery -----------------------------------------------------------------

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
        return self._recover(problem)

    def _recover(self, problem: str) -> sqlite3.Connection:
        salvaged, counters, bad = salvage(self.path)
        self.corrupt_records += bad
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(self._wall())}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                os.replace(src, Path(str(aside) + suffix))
        self.recovered_from = aside
        detail = (f"spool {self.path} was damaged ({problem}); moved to {aside}; "
                  f"{len(salvaged)} readable records salvaged")
        log.error("%s", detail)
        conn = self._connect()
        with conn:
            seqmod.raise_floor(conn, self._sidecar.recovery_floors(counters))
            for row in salvaged:
                conn.execute("INSERT INTO records(kind, topic, seq, session, created_wall, attempts, crc, payload) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
        self._drops.note("corrupt", detail)
        return conn

    def _totals(self) -> tuple[int, int]:
        with self._lock:
            n, size = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload) + LENGTH(topic)), 0) FROM records").fetchone()
        return int(n), int(size) + RECORD_OVERHEAD * int(n)

    def _mirror(self) -> None:
        self._sidecar.write(seqmod.read_all(self._conn))

    # -- writing ------------------------------------------------------------------------------------

    def append(self, kind: Kind, topic: str, build: Callable[[int], bytes]) -> Record | None:
        """Store one record; ``build(seq)`` makes the payload with its ``seq``. None when it was lost."""
        if kind not in STREAM_OF:
            raise ValueError(f"unknown record kind {kind!r}")
        with self._lock:
            for attempt in (1, 2):
                try:
                    record = self._insert(kind, topic, build)
                    break
                except sqlite3.OperationalError as exc:
                    if not _is_full(exc):
                        raise
                    if attempt == 2 or not self._evict(max(1, self.records // 10), reason="disk_full",
                                                       detail=f"disk full writing {self.path}: {exc}"):
                        self.write_errors += 1
                        self._drops.add("disk_full", kind, 0, 0, f"disk full writing {self.path}: {exc}")
                        log.error("spool %s: disk full, %s record lost", self.path, kind)
                        return None
            self._mirror()
            self._enforce_bounds()
            return record

    def _insert(self, kind: Kind, topic: str, build: Callable[[int], bytes]) -> Record:
        wall = self._wall()
        with self._conn:
            seq = seqmod.allocate(self._conn, STREAM_OF[kind])
            payload = build(seq)
            cur = self._conn.execute(
                "INSERT INTO records(kind, topic, seq, session, created_wall, crc, payload) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (kind, topic, seq, self.session, wall, zlib.crc32(payload), payload))
        record = Record(int(cur.lastrowid), kind, topic, seq, self.session, wall, 0, payload)
        self.records += 1
        self.bytes += record.size
        return record

    def _enforce_bounds(self) -> None:
        while self.records > self.max_records or self.bytes > self.max_bytes:
            if not self._evict(1, reason="full"):
                break

    def _evict(self, n: int, reason: str, detail: str | None = None) -> int:
        """Delete the ``n`` oldest records, windows before events; returns how many went."""
        rows = self._conn.execute(
            "SELECT id, kind, seq, LENGTH(payload) + LENGTH(topic) FROM records "
            "ORDER BY kind = 'event', id LIMIT ?", (n,)).fetchall()
        if not rows:
            return 0
        with self._conn:
            self._conn.executemany("DELETE FROM records WHERE id = ?", [(r[0],) for r in rows])
        for _id, kind, seq, size in rows:
            self.records -= 1
            self.bytes -= size + RECORD_OVERHEAD
            self._drops.add(reason, kind, seq, size + RECORD_OVERHEAD, detail)
        log.warning("spool %s %s: dropped %d oldest records", self.path, reason, len(rows))
        return len(rows)

    # -- reading and acknowledging --------------------------------------------------------------------

    def pending(self, limit: int = 100, exclude: set[int] | frozenset[int] = frozenset(),
                after_id: int = 0) -> list[Record]:
        """Up to ``limit`` stored records with id > ``after_id``, oldest first, skipping ``exclude``.
        Corrupt ones are deleted, counted and reported instead of returned."""
        out: list[Record] = []
        bad: list[tuple[int, str, int, int]] = []
        with self._lock:
            cur = self._conn.execute(
                "SELECT id, kind, topic, seq, session, created_wall, attempts, crc, payload FROM records "
                "WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit + len(exclude)))
            for rid, kind, topic, seq, session, wall, attempts, crc, payload in cur.fetchall():
                payload = bytes(payload)
                if kind not in STREAM_OF or zlib.crc32(payload) != crc:
                    bad.append((rid, kind, seq, len(payload) + len(topic) + RECORD_OVERHEAD))
                    continue
                if rid not in exclude and len(out) < limit:
                    out.append(Record(rid, kind, topic, seq, session, wall, attempts, payload))
            if bad:
                with self._conn:
                    self._conn.executemany("DELETE FROM records WHERE id = ?", [(b[0],) for b in bad])
                for rid, kind, seq, size in bad:
                    self.corrupt_records += 1
                    self.records -= 1
                    self.bytes -= size
                    self._drops.add("corrupt", kind if kind in STREAM_OF else "event", seq, size,
                                    f"record {rid} in {self.path} failed its checksum")
                log.error("spool %s: %d corrupt records skipped and removed", self.path, len(bad))
        return out

    def ack(self, ids: list[int]) -> int:
        """Delete acknowledged records; returns how many existed."""
        if not ids:
            return 0
        with self._lock:
            rows = self._conn.execute(
                f"SELECT id, LENGTH(payload) + LENGTH(topic) FROM records WHERE id IN ({','.join('?' * len(ids))})",
                ids).fetchall()
            with self._conn:
                self._conn.executemany("DELETE FROM records WHERE id = ?", [(r[0],) for r in rows])
            for _id, size in rows:
                self.records -= 1
                self.bytes -= size + RECORD_OVERHEAD
        return len(rows)

    def reject(self, rid: int, reason_code: int) -> bool:
        """The broker refused record ``rid``; True when it was dropped for good (attempts used up)."""
        with self._lock:
            row = self._conn.execute("SELECT kind, seq, attempts, LENGTH(payload) + LENGTH(topic), topic "
                                     "FROM records WHERE id = ?", (rid,)).fetchone()
            if row is None:
                return False
            kind, seq, attempts, size, topic = row
            with self._conn:
                if attempts + 1 < self.max_attempts:
                    self._conn.execute("UPDATE records SET attempts = attempts + 1 WHERE id = ?", (rid,))
                    return False
                self._conn.execute("DELETE FROM records WHERE id = ?", (rid,))
            self.records -= 1
            self.bytes -= size + RECORD_OVERHEAD
            self._drops.add("rejected", kind, seq, size + RECORD_OVERHEAD,
                            f"broker refused {topic} {self.max_attempts} times (reason code 0x{reason_code:02x})")
            return True

    def take_drops(self) -> list[SpoolDrop]:
        with self._lock:
            return self._drops.take()

    def stats(self) -> dict[str, int | str | None]:
        return {"records": self.records, "bytes": self.bytes, "corrupt_records": self.corrupt_records,
                "write_errors": self.write_errors, "session": self.session,
                "recovered_from": str(self.recovered_from) if self.recovered_from else None}

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except sqlite3.Error:  # pragma: no cover
                pass
