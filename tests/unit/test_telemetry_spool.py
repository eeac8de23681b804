from __future__ import annotations

import json
import os
import sqlite3

import pytest

from edge_agent.telemetry.seq import Sidecar
from edge_agent.telemetry.spool import Spool


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
    sp._conn.execute("PRAGMA max_page_count = %d" % (sp._conn.execute("PRAGMA page_count").fetchone()[0] + 2))
    results = [sp.append("window", "t", lambda q: payload(q, 3000)) for _ in range(40)]
    stored = [r for r in results if r is not None]
    assert stored, "some records fit"
    drops = {d.reason: d for d in sp.take_drops()}
    assert "disk_full" in drops
    assert drops["disk_full"].windows > 0
    # The spool still works afterwards, and every stored record is readable.
    assert all(r.payload.startswith(b"{") for r in sp.pending(100))
