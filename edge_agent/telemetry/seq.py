"""64-bit sequence numbers and the session counter, monotonic across restarts and spool loss.

The authority is the spool database's ``meta`` table, bumped in the same SQLite transaction as
the record that uses the number: a committed record and its ``seq`` are never out of step, kill -9
or not, and numbers are never skipped (a gap at a receiver therefore always means loss).

A sidecar file ``<spool>.seq`` mirrors the last values (written atomically with rename after each
commit). It is read only when the database is lost or corrupt, so that a rebuilt spool continues
above every number already published instead of starting again at 0 (which a fleet tool would take
for duplicates). No margin is added: a record is published only after the sidecar holds its number,
so a number the sidecar misses (a crash between commit and sidecar write) was never seen by anyone
and may be handed out again; skipping numbers would show a receiver a loss that never happened.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

UINT64_MAX = 2**64 - 1  # the wire type: JSON numbers, unsigned 64-bit
MAX_VALUE = 2**63 - 1  # SQLite integers are signed 64-bit: the device's counters stop here
STREAMS = ("tele", "evt")
SESSION = "session"


def allocate(conn: sqlite3.Connection, key: str) -> int:
    """Next value of counter ``key`` (first is 1). Call inside the caller's transaction."""
    conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES (?, 0)", (key,))
    (value,) = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    if value >= MAX_VALUE:  # 292 years at 1 GHz: unreachable, but never wrap or turn into a float
        raise OverflowError(f"counter {key} reached {MAX_VALUE}")
    conn.execute("UPDATE meta SET value = value + 1 WHERE key = ?", (key,))
    return int(value) + 1


def read_all(conn: sqlite3.Connection) -> dict[str, int]:
    return {str(k): int(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def raise_floor(conn: sqlite3.Connection, floors: dict[str, int]) -> None:
    """Make every counter at least its floor (after recovery). Caller commits."""
    for key, floor in floors.items():
        conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES (?, 0)", (key,))
        conn.execute("UPDATE meta SET value = MAX(value, ?) WHERE key = ?", (int(floor), key))


class Sidecar:
    """The ``<spool>.seq`` mirror: a JSON object ``{counter: last value}``."""

    def __init__(self, spool_path: Path) -> None:
        self.path = Path(str(spool_path) + ".seq")
        self._failing = False  # log a failing write once, not once per record

    def read(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text())
            return {str(k): int(v) for k, v in data.items() if isinstance(v, int) and 0 <= v <= UINT64_MAX}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("sequence sidecar %s unreadable (%s); relying on the spool database", self.path, exc)
            return {}

    def write(self, values: dict[str, int]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(values, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk must not stop telemetry; the database stays the authority
            if not self._failing:
                log.warning("cannot write sequence sidecar %s: %s", self.path, exc)
            self._failing = True
            return
        if self._failing:
            log.info("sequence sidecar %s written again", self.path)
            self._failing = False

    def recovery_floors(self, salvaged: dict[str, int]) -> dict[str, int]:
        """Counters for a rebuilt spool: the larger of the sidecar and every salvaged value, so the
        next number follows the last one handed out, with no gap."""
        side = self.read()
        keys = set(side) | set(salvaged) | set(STREAMS) | {SESSION}
        return {k: max(side.get(k, 0), salvaged.get(k, 0)) for k in keys}
