from __future__ import annotations

import itertools
import json
import os
import sqlite3
import threading

import pytest

from edge_agent.telemetry.seq import Sidecar
from edge_agent.telemetry.spool import BACKOFF_MAX_S, Spool


def payload(seq: int, size: int = 100) -> bytes:
    return json.dumps({"seq": seq, "pad": "x" * size}).encode()


def fill(spool: Spool, n: int, kind: str = "window", size: int = 100) -> list:
    return [spool.append(kind, "t/" + kind, lambda q: payload(q, size)) for _ in range(n)]


def test_seq_is_monotonic_across_restarts_and_session_counts_up(tmp_path):
    path = tmp_path / "spool.sqlite"
    sp = Spool(path)
    recs = fill(sp, 3)
    assert [r.seq for r in recs] == [1, 2, 3] and sp.session == 1
    sp.ack([recs[0].id, recs[1].id, recs[2].id])
    sp.close()
    sp = Spool(path)
    assert sp.session == 2
    assert [r.seq for r in fill(sp, 2)] == [4, 5]
    assert fill(sp, 1, "event")[0].seq == 1  # events have their own stream
    sp.close()


def test_ack_deletes_and_pending_is_oldest_first(tmp_path):
    sp = Spool(tmp_path / "s.sqlite")
    recs = fill(sp, 5)
    assert [r.seq for r in sp.pending(3)] == [1, 2, 3]
    assert sp.ack([recs[0].id, recs[2].id]) == 2
    assert [r.seq for r in sp.pending(10)] == [2, 4, 5]
    assert [r.seq for r in sp.pending(10, exclude={recs[1].id})] == [4, 5]
    assert sp.records == 3


def test_full_spool_drops_oldest_windows_before_events_and_reports(tmp_path):
    sp = Spool(tmp_path / "s.sqlite", max_records=6)
    fill(sp, 2, "event")
    fill(sp, 8, "window")
    kinds = [(r.kind, r.seq) for r in sp.pending(20)]
    assert kinds == [("event", 1), ("event", 2), ("window", 5), ("window", 6), ("window", 7), ("window", 8)]
    (drop,) = sp.take_drops()
    assert drop.reason == "full" and drop.windows == 4 and drop.events == 0
    assert drop.seq_ranges == [(1, 4)]
    assert sp.take_drops() == []


def test_byte_bound_is_kept(tmp_path):
    sp = Spool(tmp_path / "s.sqlite", max_bytes=8192)
    fill(sp, 50, size=500)
    assert sp.bytes <= 8192
    assert sp.take_drops()[0].windows > 0


def test_rejected_record_is_dropped_after_max_attempts(tmp_path):
    sp = Spool(tmp_path / "s.sqlite", max_attempts=2)
    (rec,) = fill(sp, 1)
    assert sp.reject(rec.id, 0x87) is False
    assert sp.reject(rec.id, 0x87) is True
    (drop,) = sp.take_drops()
    assert drop.reason == "rejected" and "0x87" in drop.detail and drop.seq_ranges == [(1, 1)]


def test_corrupt_record_is_skipped_counted_and_reported(tmp_path):
    path = tmp_path / "s.sqlite"
    sp = Spool(path)
    recs = fill(sp, 3)
    with sqlite3.connect(path) as conn:  # a torn / bit-flipped payload
        conn.execute("UPDATE records SET payload = ? WHERE id = ?", (b'{"seq": 2, "pad": "xx', recs[1].id))
    assert [r.seq for r in sp.pending(10)] == [1, 3]
    assert sp.corrupt_records == 1
    (drop,) = sp.take_drops()
    assert drop.reason == "corrupt" and drop.seq_ranges == [(2, 2)] and "checksum" in drop.detail


@pytest.mark.parametrize("damage", ["garbage", "truncate"])
def test_damaged_file_is_moved_aside_salvaged_and_seq_continues(tmp_path, damage):
    path = tmp_path / "s.sqlite"
    sp = Spool(path)
    fill(sp, 200, size=300)
    sp.close()
    for extra in ("-wal", "-shm"):
        assert not os.path.exists(str(path) + extra) or True
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"this is not a database" * 100)
    else:
        path.write_bytes(data[: len(data) // 2])
    sp = Spool(path)  # never raises
    assert sp.recovered_from is not None and sp.recovered_from.exists()
    (drop,) = sp.take_drops()
    assert drop.reason == "corrupt" and str(sp.recovered_from) in drop.detail
    # Numbers continue above everything handed out before, thanks to the sidecar.
    new = fill(sp, 1)[0]
    assert new.seq > 200
    salvaged = sp.pending(1000)
    assert all(r.seq <= 200 for r in salvaged[:-1])
    if damage == "truncate":
        assert 0 < len(salvaged) - 1 < 200


def test_sidecar_survives_unreadable_content(tmp_path):
    side = Sidecar(tmp_path / "s.sqlite")
    side.path.write_text("{not json")
    assert side.read() == {}
    side.write({"tele": 7})
    assert side.recovery_floors({})["tele"] == 7


def test_disk_full_drops_oldest_windows_then_reports_loss(tmp_path):
    path = tmp_path / "s.sqlite"
    sp = Spool(path)
    # A real SQLITE_FULL: cap the database's page count (what a full disk looks like to SQLite).
    sp._conn.execute(f"PRAGMA max_page_count = {sp._conn.execute('PRAGMA page_count').fetchone()[0] + 2:d}")
    results = [sp.append("window", "t", lambda q: payload(q, 3000)) for _ in range(40)]
    stored = [r for r in results if r is not None]
    assert stored, "some records fit"
    drops = {d.reason: d for d in sp.take_drops()}
    assert "disk_full" in drops
    assert drops["disk_full"].windows > 0
    # The spool still works afterwards, and every stored record is readable.
    assert all(r.payload.startswith(b"{") for r in sp.pending(100))


# -- a full disk: degraded, never raising, every lost window numbered and reported ---------------------


class FullDisk:
    """The spool's connection with a switchable full disk: while ``full``, every statement that
    writes fails as SQLite fails on ENOSPC (reads still work, as on a real full disk)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn, self.full, self.writes_tried = conn, False, 0

    def _check(self, sql: str) -> None:
        if sql.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            self.writes_tried += 1
            if self.full:
                raise sqlite3.OperationalError("database or disk is full")

    def execute(self, sql, params=()):
        self._check(sql)
        return self.conn.execute(sql, params)

    def executemany(self, sql, rows):
        self._check(sql)
        return self.conn.executemany(sql, rows)

    def __enter__(self):
        return self.conn.__enter__()

    def __exit__(self, *exc):
        return self.conn.__exit__(*exc)

    def close(self) -> None:
        self.conn.close()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def full_disk_spool(path, **kw) -> tuple[Spool, FullDisk, Clock]:
    clock = Clock()
    sp = Spool(path, clock=clock, **kw)
    disk = sp._conn = FullDisk(sp._conn)
    return sp, disk, clock


def rows(path) -> list[tuple[str, int]]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT kind, seq FROM records ORDER BY id").fetchall()


def test_full_disk_never_raises_lost_windows_keep_their_seq_and_the_spool_recovers(tmp_path):
    path = tmp_path / "s.sqlite"
    sp, disk, clock = full_disk_spool(path)
    recs = fill(sp, 3)
    disk.full = True
    assert sp.degraded is None
    lost = [sp.append("window", "t", lambda q: payload(q)) for _ in range(3)]  # must not raise
    assert lost == [None, None, None]
    assert sp.degraded is not None and "disk full" in sp.degraded
    assert sp.ack([recs[0].id]) == 1  # the DELETE cannot run: the record is hidden, deleted later
    assert [r.seq for r in sp.pending(10)] == [2, 3]
    clock.t += BACKOFF_MAX_S
    disk.full = False
    new = sp.append("window", "t", lambda q: payload(q))
    assert new.seq == 7, "the three lost windows took seq 4-6: a receiver sees the gap"
    assert sp.degraded is None
    assert rows(path) == [("window", 2), ("window", 3), ("window", 7)]  # the acked one is gone now
    (drop,) = sp.take_drops()
    assert drop.reason == "disk_full" and drop.windows == 3 and drop.seq_ranges == [(4, 6)]
    sp.close()
    assert fill(Spool(path), 1)[0].seq == 8, "the jump over the lost seqs was committed"


def test_full_disk_retries_with_a_back_off_and_logs_once_per_change(tmp_path, caplog):
    sp, disk, clock = full_disk_spool(tmp_path / "s.sqlite")
    fill(sp, 2)
    disk.full = True
    caplog.set_level("INFO", logger="edge_agent.telemetry")
    tries = []
    for _ in range(400):  # 40 s of windows every 0.1 s on a full disk
        before = disk.writes_tried
        assert sp.append("window", "t", lambda q: payload(q)) is None
        if disk.writes_tried > before:
            tries.append(round(clock.t - 1000.0, 1))
        clock.t += 0.1
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[:4] == pytest.approx([1.0, 2.0, 4.0, 8.0], abs=0.11) and max(gaps) <= BACKOFF_MAX_S + 0.11
    assert len(tries) < 10
    disk.full = False
    clock.t += BACKOFF_MAX_S
    assert sp.append("window", "t", lambda q: payload(q)) is not None
    lines = [r for r in caplog.records if r.name.endswith("spool")]
    assert [r.levelname for r in lines] == ["ERROR", "WARNING"], [r.getMessage() for r in lines]
    assert "degraded" in lines[0].getMessage() and "writable again" in lines[1].getMessage()
    (drop,) = sp.take_drops()
    assert drop.windows == 400 and drop.seq_ranges == [(3, 402)]


def test_a_loss_report_is_kept_until_its_event_is_stored(tmp_path):
    sp, disk, clock = full_disk_spool(tmp_path / "s.sqlite")
    disk.full = True
    sp.append("window", "t", lambda q: payload(q))  # seq 1, lost
    seen = []

    def store(drop) -> bool:
        seen.append(drop)
        return sp.append("event", "evt/spool_drop", lambda q: payload(q), keep=True) is not None

    assert sp.report_drops(store) == 0  # the disk is full: the report cannot be written either
    assert sp.report_drops(store) == 0
    clock.t += BACKOFF_MAX_S
    sp.append("window", "t", lambda q: payload(q))  # seq 2, lost too (the disk is still full)
    disk.full = False
    clock.t += BACKOFF_MAX_S
    assert sp.report_drops(store) == 1
    assert seen[-1].windows == 2 and seen[-1].seq_ranges == [(1, 2)] and seen[-1].events == 0
    assert sp.take_drops() == []
    assert [k for k, _s in rows(sp.path)] == ["event"]
    assert fill(sp, 1)[0].seq == 3


def test_a_report_of_many_ranges_is_split_exactly(tmp_path):
    sp = Spool(tmp_path / "s.sqlite", max_attempts=1)
    recs = fill(sp, 70)
    for r in recs[::2]:  # 35 separate single-seq losses: more ranges than one report holds
        assert sp.reject(r.id, 0x87)
    drops = sp.take_drops()
    assert [len(d.seq_ranges) for d in drops] == [32, 3]
    named = [v for d in drops for lo, hi in d.seq_ranges for v in range(lo, hi + 1)]
    assert sorted(named) == [r.seq for r in recs[::2]]  # not one seq more: nothing folded together
    assert [d.windows for d in drops] == [32, 3]


def damage_index(path) -> None:
    """Overwrite the records index's page: the integrity check fails, the table itself is intact."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'records_kind'").fetchone()
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    with path.open("r+b") as fh:
        fh.seek((root - 1) * size)
        fh.write(b"\xa5" * size)


def test_a_rebuilt_spool_continues_right_after_the_salvaged_records(tmp_path):
    """The sidecar agrees with what was salvaged: no margin, no gap, the session goes up by one."""
    path = tmp_path / "s.sqlite"
    sp = Spool(path)
    fill(sp, 25)
    sp.close()
    damage_index(path)
    sp = Spool(path)
    assert sp.recovered_from is not None
    assert sp.session == 2
    assert [r.seq for r in sp.pending(100)] == list(range(1, 26))
    assert fill(sp, 1)[0].seq == 26
    (drop,) = sp.take_drops()
    assert drop.reason == "corrupt" and drop.windows == 0 and drop.seq_ranges == []


def test_windows_with_a_bad_checksum_in_a_damaged_file_are_announced_by_seq(tmp_path):
    path = tmp_path / "s.sqlite"
    sp = Spool(path)
    fill(sp, 10)
    sp.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE records SET payload = X'00' WHERE seq IN (4, 5)")
    damage_index(path)
    sp = Spool(path)
    assert sp.recovered_from is not None
    (drop,) = sp.take_drops()
    assert drop.reason == "corrupt" and drop.seq_ranges == [(4, 5)] and drop.windows == 2
    assert fill(sp, 1)[0].seq == 11


class VirtualWaits(threading.Event):
    """The publisher's wake-up event on a virtual clock: every timed ``wait`` returns at once, moving
    the clock on by what was asked and recording it, so the loop's pace is read, not slept through.
    After ``until`` waits the loop is held in its wait (a real one, bounded only as a safety net) and
    ``reached`` is set; ``stop()`` (which sets this event) lets it go."""

    def __init__(self, until: int, start: float = 1000.0) -> None:
        super().__init__()
        self.now, self.until = start, until
        self.waits: list[float] = []
        self.reached = threading.Event()

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1.7e9 + self.now  # moves with the monotonic clock: no clock-jump events

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None, "the telemetry loop waits with a timeout"
        if self.is_set():
            return True
        self.waits.append(timeout)
        self.now += timeout
        if len(self.waits) < self.until:
            return False
        self.reached.set()
        return super().wait(10)


def test_the_telemetry_loop_backs_off_when_the_spool_keeps_failing(tmp_path, caplog):
    """A spool error that is not a full disk (here: an I/O error on every write) must not spin the
    loop: one traceback, then turns retried after a back-off that doubles up to its cap."""
    from edge_agent.telemetry.publisher import ERROR_BACKOFF_MAX_S, ERROR_BACKOFF_MIN_S, Identity, Publisher
    from edge_agent.telemetry.windows import WindowAccumulator

    sp = Spool(tmp_path / "s.sqlite")
    real = sp._conn

    class Broken(FullDisk):
        def _check(self, sql: str) -> None:
            if sql.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE"):
                raise sqlite3.OperationalError("disk I/O error")

    sp._conn = Broken(real)
    failures = 9
    waits = VirtualWaits(until=1 + failures)
    pub = Publisher(
        None,
        sp,
        WindowAccumulator(),
        Identity("dev-1", "t", "boot"),
        interval_s=0.01,
        clock=waits.clock,
        wall=waits.wall,
        clock_synced=lambda: True,
    )
    pub._wake = waits  # the loop's only pause: every wait it makes is now recorded
    caplog.set_level("INFO", logger="edge_agent.telemetry")
    pub.start()
    try:
        assert waits.reached.wait(10), f"the loop stopped turning after {waits.waits}"
    finally:
        pub.stop()
    # one ordinary wait for the first window, then a failed seal per turn, each after a longer back-off
    first, *backoffs = waits.waits
    assert first == pytest.approx(0.01)
    expected = [min(ERROR_BACKOFF_MAX_S, ERROR_BACKOFF_MIN_S * 2**k) for k in range(failures)]
    assert backoffs == expected and expected[-1] == ERROR_BACKOFF_MAX_S == 30.0
    assert pub.stats["loop_errors"] == failures
    assert sum(r.exc_info is not None for r in caplog.records) == 1
