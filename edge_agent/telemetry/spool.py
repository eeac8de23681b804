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
- a full disk (SQLITE_FULL) drops the oldest windows and retries once; if it still fails the spool
  is *degraded* (``degraded`` says why) until a write succeeds again: no write raises, a window that
  cannot be stored is lost but still takes its ``seq`` (kept in memory and committed with the next
  record that fits), so a receiver sees the gap and the ``disk_full`` report names it; the disk is
  tried again after a back-off (1 s doubling to 8 s), and one log line marks each change of state.
  Deletes that fail (acks, corrupt rows) are remembered and done once space returns. A start on a
  full disk is not taken for damage: the file is left alone and opened once space returns.

Loss reports are handed out by ``report_drops``, which puts a report back when its event could not
be stored, so a loss is never forgotten because the report of it was lost too.

Single writer: the telemetry thread. A lock guards the connection anyway.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import seq as seqmod
from .diskfull import BACKOFF_MAX_S, BACKOFF_MIN_S, DiskFull, is_full, low_space
from .drops import Drops
from .salvage import STREAM_OF
from .schema import SpoolDrop
from .spool_file import RECORD_OVERHEAD, SpoolFile

log = logging.getLogger(__name__)

Kind = Literal["window", "event"]
__all__ = ["BACKOFF_MAX_S", "BACKOFF_MIN_S", "Record", "Spool"]


@dataclass(frozen=True, slots=True)
class Record:
    """One spooled message: its row id, kind, topic, ``seq``, the session that wrote it, and its payload."""

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


class Spool(SpoolFile):
    """The store-and-forward spool (see the module doc): bounded, crash-safe, never raising on a full disk."""

    def __init__(
        self,
        path: Path | str,
        max_bytes: int = 64 * 1024 * 1024,
        max_records: int = 100_000,
        max_attempts: int = 5,
        *,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 4096 or max_records < 2:
            raise ValueError("spool bounds too small: max_bytes >= 4096 and max_records >= 2")
        self.path = Path(path)
        self.max_bytes, self.max_records, self.max_attempts = max_bytes, max_records, max_attempts
        self._wall = wall
        self._lock = threading.RLock()
        self._drops = Drops()
        self._sidecar = seqmod.Sidecar(self.path)
        self.corrupt_records = 0  # CRC mismatches or unreadable rows, since open
        self.write_errors = 0  # records lost because the disk was full, since open
        self.recovered_from: Path | None = None  # where a damaged file was moved, if it was
        # Full disk: numbers given to lost records (committed with the next record that fits), rows
        # already dealt with whose DELETE failed, and the retry schedule.
        self._reserved: dict[str, int] = {}
        self._doomed: set[int] = set()
        self._full = DiskFull(self.path, clock)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._attached = True  # False: started on a full disk, the file is not open yet
        try:
            self._conn = self._open()
            with self._lock, self._conn:
                self.session = seqmod.allocate(self._conn, seqmod.SESSION)
        except sqlite3.Error as exc:
            if not (is_full(exc) or low_space(self.path)):
                raise
            self._conn = self._detached(exc)
        self._mirror()
        self.records, self.bytes = self._totals()

    # -- a full disk ----------------------------------------------------------------------------------

    @property
    def degraded(self) -> str | None:
        """Why the spool cannot store records right now (a full disk), or None while it can."""
        return self._full.degraded

    def _wrote(self) -> None:
        """A write went through: leave the degraded state and finish the deletes that had failed."""
        self._full.wrote()
        if self._doomed:
            self._delete(list(self._doomed))

    def _delete(self, ids: list[int], remember: bool = True) -> bool:
        """DELETE rows. On a full disk rows already dealt with (``remember``: acked, reported) are
        hidden from ``pending`` and deleted later; rows to evict simply stay."""
        try:
            with self._conn:
                self._conn.executemany("DELETE FROM records WHERE id = ?", [(i,) for i in ids])
        except sqlite3.OperationalError as exc:
            if not is_full(exc):
                raise
            if remember:
                self._doomed.update(ids)
            self._full.failed(exc)
            return False
        self._doomed.difference_update(ids)
        return True

    # -- writing ------------------------------------------------------------------------------------

    def append(self, kind: Kind, topic: str, build: Callable[[int], bytes], *, keep: bool = False) -> Record | None:
        """Store one record; ``build(seq)`` makes the payload with its ``seq``. None when it could not be
        stored: then it is lost and reported, or, with ``keep``, the caller keeps it to try again and
        nothing is counted."""
        if kind not in STREAM_OF:
            raise ValueError(f"unknown record kind {kind!r}")
        with self._lock:
            record = None
            if self._full.may_write() and (self._attached or self._attach()):
                record = self._try_insert(kind, topic, build)
            if record is None:
                if not keep:
                    self._lose(kind, build)
                return None
            self._wrote()
            self._mirror()
            self._enforce_bounds()
            return record

    def _try_insert(self, kind: Kind, topic: str, build: Callable[[int], bytes]) -> Record | None:
        """Insert; on SQLITE_FULL make room once (oldest windows) and try again; None if still full."""
        for attempt in (1, 2):
            try:
                return self._insert(kind, topic, build)
            except sqlite3.OperationalError as exc:
                if not is_full(exc):
                    raise
                if attempt == 2 or not self._evict(
                    max(1, self.records // 10), reason="disk_full", detail=f"disk full writing {self.path}: {exc}"
                ):
                    self._full.failed(exc)
                    return None
        return None  # pragma: no cover (the loop returns)

    def _lose(self, kind: Kind, build: Callable[[int], bytes]) -> None:
        """A record that could not be stored. A window still takes the next ``seq`` (in memory, made
        durable by the next commit), so a receiver sees a gap that the ``disk_full`` report names."""
        stream = STREAM_OF[kind]
        seq = 0
        if kind == "window":
            (stored,) = self._conn.execute(
                "SELECT COALESCE(MAX(value), 0) FROM meta WHERE key = ?", (stream,)
            ).fetchone()
            seq = self._reserved[stream] = max(int(stored), self._reserved.get(stream, 0)) + 1
        try:
            size = len(build(seq)) + RECORD_OVERHEAD
        except ValueError:
            size = RECORD_OVERHEAD
        self.write_errors += 1
        self._full.lost += 1
        self._drops.add("disk_full", kind, seq, size, self._full.error or f"disk full writing {self.path}")

    def _insert(self, kind: Kind, topic: str, build: Callable[[int], bytes]) -> Record:
        wall = self._wall()
        with self._conn:
            if self._reserved:  # numbers of records lost on a full disk: never hand them out again
                seqmod.raise_floor(self._conn, self._reserved)
            seq = seqmod.allocate(self._conn, STREAM_OF[kind])
            payload = build(seq)
            cur = self._conn.execute(
                "INSERT INTO records(kind, topic, seq, session, created_wall, crc, payload)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (kind, topic, seq, self.session, wall, zlib.crc32(payload), payload),
            )
        self._reserved = {}
        assert cur.lastrowid is not None  # an INSERT always sets it
        record = Record(cur.lastrowid, kind, topic, seq, self.session, wall, 0, payload)
        self.records += 1
        self.bytes += record.size
        return record

    def _enforce_bounds(self) -> None:
        while self.records > self.max_records or self.bytes > self.max_bytes:
            if not self._evict(1, reason="full"):
                break

    def _evict(self, n: int, reason: str, detail: str | None = None) -> int:
        """Delete the ``n`` oldest records, windows before events; returns how many went."""
        rows = [
            r
            for r in self._conn.execute(
                "SELECT id, kind, seq, LENGTH(payload) + LENGTH(topic) FROM records "
                "ORDER BY kind = 'event', id LIMIT ?",
                (n + len(self._doomed),),
            ).fetchall()
            if r[0] not in self._doomed
        ]
        rows = rows[:n]
        if not rows or not self._delete([r[0] for r in rows], remember=False):
            return 0
        for _id, kind, seq, size in rows:
            self.records -= 1
            self.bytes -= size + RECORD_OVERHEAD
            self._drops.add(reason, kind, seq, size + RECORD_OVERHEAD, detail)
        log.log(
            logging.WARNING if reason == "full" else logging.INFO,
            "spool %s %s: dropped %d oldest records",
            self.path,
            reason,
            len(rows),
        )
        return len(rows)

    # -- reading and acknowledging --------------------------------------------------------------------

    def pending(
        self, limit: int = 100, exclude: set[int] | frozenset[int] = frozenset(), after_id: int = 0
    ) -> list[Record]:
        """Up to ``limit`` stored records with id > ``after_id``, oldest first, skipping ``exclude``.
        Corrupt ones are deleted, counted and reported instead of returned."""
        out: list[Record] = []
        bad: list[tuple[int, str, int, int]] = []
        with self._lock:
            skip = set(exclude) | self._doomed
            cur = self._conn.execute(
                "SELECT id, kind, topic, seq, session, created_wall, attempts, crc, payload FROM records "
                "WHERE id > ? ORDER BY id LIMIT ?",
                (after_id, limit + len(skip)),
            )
            for rid, kind, topic, seq, session, wall, attempts, crc, payload in cur.fetchall():
                if rid in self._doomed:
                    continue
                payload = bytes(payload)
                if kind not in STREAM_OF or zlib.crc32(payload) != crc:
                    bad.append((rid, kind, seq, len(payload) + len(topic) + RECORD_OVERHEAD))
                    continue
                if rid not in skip and len(out) < limit:
                    out.append(Record(rid, kind, topic, seq, session, wall, attempts, payload))
            if bad:
                self._delete([b[0] for b in bad])  # on a full disk: hidden now, deleted later
                for rid, kind, seq, size in bad:
                    self.corrupt_records += 1
                    self.records -= 1
                    self.bytes -= size
                    self._drops.add(
                        "corrupt",
                        kind if kind in STREAM_OF else "event",
                        seq,
                        size,
                        f"record {rid} in {self.path} failed its checksum",
                    )
                log.error("spool %s: %d corrupt records skipped and removed", self.path, len(bad))
        return out

    def ack(self, ids: list[int]) -> int:
        """Delete acknowledged records; returns how many existed. On a full disk they are hidden from
        ``pending`` at once (never sent twice) and deleted once a write succeeds."""
        if not ids:
            return 0
        with self._lock:
            rows = [
                r
                for r in self._conn.execute(
                    f"SELECT id, LENGTH(payload) + LENGTH(topic) FROM records WHERE id IN ({','.join('?' * len(ids))})",
                    ids,
                ).fetchall()
                if r[0] not in self._doomed
            ]
            if not rows:
                return 0
            if not self._full.may_write():
                self._doomed.update(r[0] for r in rows)
            elif self._delete([r[0] for r in rows]):
                self._wrote()
            for _id, size in rows:
                self.records -= 1
                self.bytes -= size + RECORD_OVERHEAD
        return len(rows)

    def reject(self, rid: int, reason_code: int) -> bool:
        """The broker refused record ``rid``; True when it was dropped for good (attempts used up)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT kind, seq, attempts, LENGTH(payload) + LENGTH(topic), topic FROM records WHERE id = ?", (rid,)
            ).fetchone()
            if row is None or rid in self._doomed:
                return False
            kind, seq, attempts, size, topic = row
            if attempts + 1 < self.max_attempts:
                try:
                    with self._conn:
                        self._conn.execute("UPDATE records SET attempts = attempts + 1 WHERE id = ?", (rid,))
                except sqlite3.OperationalError as exc:  # on a full disk the count waits; the retry does not
                    if not is_full(exc):
                        raise
                    self._full.failed(exc)
                return False
            self._delete([rid])
            self.records -= 1
            self.bytes -= size + RECORD_OVERHEAD
            self._drops.add(
                "rejected",
                kind,
                seq,
                size + RECORD_OVERHEAD,
                f"broker refused {topic} {self.max_attempts} times (reason code 0x{reason_code:02x})",
            )
            return True

    def take_drops(self) -> list[SpoolDrop]:
        """Every loss not yet reported, as reports, forgotten here (``report_drops`` is the safe way)."""
        with self._lock:
            return self._drops.take()

    def report_drops(self, store: Callable[[SpoolDrop], bool]) -> int:
        """Hand each pending loss report to ``store`` (which appends it as an event, with ``keep``);
        a report ``store`` could not write is kept for the next call. Returns how many were stored."""
        with self._lock:
            return self._drops.report(store)

    def stats(self) -> dict[str, int | str | None]:
        return {
            "records": self.records,
            "bytes": self.bytes,
            "corrupt_records": self.corrupt_records,
            "write_errors": self.write_errors,
            "session": self.session,
            "recovered_from": str(self.recovered_from) if self.recovered_from else None,
            "degraded": self.degraded,
        }

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except sqlite3.Error:  # pragma: no cover
                pass
