"""Reading what is left of a damaged spool file, for ``Spool`` to rebuild from.

A truncated SQLite file keeps its old page count in the header, and SQLite then refuses every page
("database disk image is malformed"), even the intact ones. The salvage works on a copy cut to whole
pages with that count cleared, scans the records, and where the scan hits an unreadable page,
probes ids one by one: every leaf page still referenced by a readable interior page comes back.
Only records whose CRC32 matches are kept; the ``seq`` of a window whose row is readable but whose
CRC does not match is returned too, so that its loss can be announced exactly.
"""

from __future__ import annotations

import logging
import sqlite3
import zlib
from pathlib import Path

from . import seq as seqmod

log = logging.getLogger(__name__)

STREAM_OF = {"window": "tele", "event": "evt"}
MAX_PROBES = 1_000_000
_SELECT = "SELECT kind, topic, seq, session, created_wall, attempts, crc, payload FROM records "


def patched_copy(src: Path, dst: Path) -> None:
    """Copy a damaged database so SQLite will read what is left of it: a truncated file keeps
    its old page count in the header, and SQLite then refuses every page; cut the copy to whole
    pages and clear that count so the file size is used instead."""
    data = bytearray(src.read_bytes())
    if len(data) >= 100 and data[:16] == b"SQLite format 3\x00":
        page = int.from_bytes(data[16:18], "big")
        page = 65536 if page == 1 else page
        if page >= 512:
            data = data[: len(data) // page * page]
            data[28:32] = (len(data) // page).to_bytes(4, "big")
    dst.write_bytes(bytes(data))
    wal = Path(str(src) + "-wal")
    if wal.exists():
        Path(str(dst) + "-wal").write_bytes(wal.read_bytes())


def salvage(path: Path) -> tuple[list[tuple], dict[str, int], int, list[int]]:
    """(readable records as insert tuples, counters, records skipped as corrupt, the seqs of the
    corrupt windows among them) of a damaged file."""
    rows: list[tuple] = []
    counters: dict[str, int] = {}
    bad = 0
    bad_windows: list[int] = []
    copy = path.with_name(path.name + ".salvage")
    try:
        patched_copy(path, copy)
        conn = sqlite3.connect(copy)
    except (OSError, sqlite3.Error) as exc:
        log.warning("spool %s: nothing salvageable (%s)", path, exc)
        return rows, counters, bad, bad_windows

    def keep(row: tuple) -> None:
        nonlocal bad
        if row[0] in STREAM_OF and isinstance(row[7], bytes) and zlib.crc32(row[7]) == row[6]:
            rows.append(row)
        else:
            bad += 1
            if row[0] == "window" and isinstance(row[2], int) and row[2] > 0:
                bad_windows.append(row[2])

    try:
        try:
            counters = seqmod.read_all(conn)
        except sqlite3.Error:
            pass
        try:
            for row in conn.execute(_SELECT + "ORDER BY id"):
                keep(row)
        except sqlite3.Error as exc:
            log.warning("spool scan stopped after %d records (%s); probing ids one by one", len(rows), exc)
            rows.clear()
            bad = 0
            bad_windows.clear()
            try:
                conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'records'").fetchone()
            except sqlite3.Error:
                return rows, counters, bad, bad_windows  # not even the catalogue is readable: nothing to probe
            # Ids never exceed the number of records ever appended, which the counters bound.
            upper = sum(v for k, v in counters.items() if k in STREAM_OF.values()) or MAX_PROBES
            for rid in range(1, min(upper, MAX_PROBES) + 1):
                try:
                    row = conn.execute(_SELECT + "WHERE id = ?", (rid,)).fetchone()
                except sqlite3.Error:
                    continue
                if row is not None:
                    keep(row)
        for row in rows:  # salvaged seqs count as handed out
            key = STREAM_OF[row[0]]
            counters[key] = max(counters.get(key, 0), int(row[2]))
        if bad_windows:  # so do those of corrupt windows: their loss is reported, never reused
            counters["tele"] = max(counters.get("tele", 0), max(bad_windows))
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(str(copy) + suffix).unlink(missing_ok=True)
    return rows, counters, bad, bad_windows
