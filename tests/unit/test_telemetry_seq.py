from __future__ import annotations

import sqlite3

import pytest

from edge_agent.telemetry import seq


@pytest.fixture
def conn():
    c = sqlite3.connect(":memory:")
    c.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    return c


def test_allocate_counts_from_one_per_key_and_rolls_back_with_the_transaction(conn):
    with conn:
        assert [seq.allocate(conn, "tele") for _ in range(3)] == [1, 2, 3]
        assert seq.allocate(conn, "evt") == 1
    with pytest.raises(RuntimeError), conn:
        seq.allocate(conn, "tele")
        raise RuntimeError("the record's insert failed")
    with conn:
        assert seq.allocate(conn, "tele") == 4  # no number was skipped


def test_counter_refuses_to_pass_64_bits(conn):
    conn.execute("INSERT INTO meta VALUES ('tele', ?)", (seq.MAX_VALUE - 1,))
    assert seq.allocate(conn, "tele") == seq.MAX_VALUE
    with pytest.raises(OverflowError):
        seq.allocate(conn, "tele")


def test_raise_floor_only_moves_counters_up(conn):
    with conn:
        for _ in range(10):
            seq.allocate(conn, "tele")
        seq.raise_floor(conn, {"tele": 5, "evt": 7})
    assert seq.read_all(conn) == {"tele": 10, "evt": 7}


def test_recovery_floors_take_the_max_of_sidecar_and_salvage_with_no_margin(tmp_path):
    side = seq.Sidecar(tmp_path / "spool.sqlite")
    assert side.recovery_floors({}) == {"tele": 0, "evt": 0, "session": 0}
    side.write({"tele": 100, "evt": 5, "session": 3})
    floors = side.recovery_floors({"tele": 130, "evt": 1})
    # A margin would skip numbers nobody ever saw, which a receiver reads as lost windows.
    assert floors == {"tele": 130, "evt": 5, "session": 3}
    assert side.recovery_floors({"tele": 100, "evt": 5, "session": 3}) == {"tele": 100, "evt": 5, "session": 3}
