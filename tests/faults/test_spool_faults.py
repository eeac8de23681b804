"""Spool faults from outside: a real telemetry process (``tests/telemetry_spool_proc.py``), a real
mosquitto and an MQTT listener holding every message.

- A full disk (a small tmpfs filled by a filler file) must leave telemetry degraded but alive: a
  bounded log, ``state`` = ``degraded`` (retained), ``online`` again once the filler is deleted, and
  every window lost meanwhile named, with its exact ``seq``, by a ``spool_drop`` event.
- kill -9 during an outage, then a damaged spool file: the rebuilt spool continues ``seq`` right
  after the salvaged records (or announces the exact gap) and the session goes up by one.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.mqtt_broker import Broker, TcpProxy, wait_for
from tests.telemetry_helpers import Watcher

DISK_FULL_S = 20.0
MAX_LOG_LINES = 50


def _agent(port: int, workdir: Path, log: Path, interval_s: float = 0.1) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.telemetry_spool_proc", str(port), str(workdir), str(interval_s)]
    with log.open("ab") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _session(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline().strip()
    assert line.startswith("session "), f"agent did not start: {line!r}"
    return int(line.split()[1])


def _lines(log: Path) -> int:
    return len(log.read_bytes().splitlines()) if log.exists() else 0


def _reported(w: Watcher) -> tuple[set[int], int]:
    """Window seqs the spool_drop events name, and the windows they count."""
    seqs: set[int] = set()
    count = 0
    for d in w.docs("evt/spool_drop"):
        count += d["data"]["windows"]
        for lo, hi in d["data"]["seq_ranges"]:
            seqs.update(range(lo, hi + 1))
    return seqs, count


def _missing(w: Watcher) -> set[int]:
    seen = set(w.seqs())
    return set(range(1, max(seen) + 1)) - seen if seen else set()


def _states(w: Watcher) -> list[str]:
    return [d["state"] for d in w.docs("/state")]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of its own, so that filling it touches nothing else."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def _fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` (bounded: a tmpfs of 16 MiB at most)."""
    filler = disk / "filler"
    chunk = b"\0" * 65536
    with filler.open("wb") as fh:
        for _ in range(16 * 1024 * 1024 // len(chunk) + 1):
            try:
                fh.write(chunk)
                fh.flush()
            except OSError:
                break
    return filler


def _silent_losses(w: Watcher, interval_s: float) -> int:
    """Windows lost without a trace: consecutive seqs of one run whose windows do not touch in time
    (each window starts at the monotonic instant its predecessor ended), counted in intervals."""
    docs = {d["seq"]: (d["session"], d["window"]) for d in w.docs("tele/latency")}
    lost = 0
    for seq, (session, win) in docs.items():
        prev = docs.get(seq - 1)
        if prev is not None and prev[0] == session and win["start_mono"] != prev[1]["end_mono"]:
            lost += max(1, round((win["start_mono"] - prev[1]["end_mono"]) / interval_s))
    return lost


def test_full_disk_degrades_telemetry_and_it_recovers_without_restart(tmp_path, small_disk):
    """The field case: windows wait in the spool through a short outage, the disk fills up, the link
    comes back (acks to apply, a backlog to send) while the disk stays full for 20 s."""
    log = tmp_path / "agent.log"
    interval = 0.1
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        w = Watcher(broker.port)
        agent = _agent(proxy.port, small_disk, log, interval)
        try:
            assert _session(agent) == 1
            wait_for(lambda: len(w.seqs()) >= 10, 30, what="first windows")
            proxy.cut()
            time.sleep(2.0)
            filler = _fill(small_disk)
            lines_before, t0 = _lines(log), time.monotonic()
            proxy.heal()
            degraded = False
            while time.monotonic() - t0 < DISK_FULL_S:  # the disk stays full this long
                degraded = degraded or "degraded" in _states(w)
                time.sleep(0.2)
            lines_full = _lines(log) - lines_before
            last_before = max(w.seqs())
            alive_while_full = agent.poll() is None
            filler.unlink()
            t1 = time.monotonic()
            try:
                wait_for(
                    lambda: _states(w)[-1:] == ["online"] and max(w.seqs()) > last_before + 5,
                    30,
                    what="state online and new windows after space returned",
                )
                recovered_s = time.monotonic() - t1
            except AssertionError:
                recovered_s = None
            try:  # every missing seq named by a spool_drop (the report may follow the new windows)
                wait_for(lambda: _missing(w) and _missing(w) == _reported(w)[0], 30, what="the loss report")
            except AssertionError:
                pass
        finally:
            _kill(agent)
        missing, (reported, counted) = _missing(w), _reported(w)
        silent = _silent_losses(w, interval)
        states = _states(w)
        w.close()
    print(
        f"\ndisk full {DISK_FULL_S:.0f} s: {lines_full} log lines ({lines_full / DISK_FULL_S:.1f}/s), "
        f"states {states}, recovered in {recovered_s} s; windows lost: {len(missing)} as seq gaps "
        f"+ {silent} without a seq; reported {counted} windows with {len(reported)} seqs"
    )
    assert alive_while_full, "the agent died on a full disk"
    assert lines_full < MAX_LOG_LINES, f"{lines_full} log lines in {DISK_FULL_S:.0f} s: {log.read_text()[-3000:]}"
    assert degraded, f"state never said degraded: {states}"
    assert recovered_s is not None, f"no recovery after the disk was freed: states {states}"
    assert silent == 0, f"{silent} windows vanished without a seq gap a receiver could see"
    assert missing, "a full disk for 20 s loses windows"
    assert reported == missing and counted == len(missing), (
        f"missing {sorted(missing)[:10]}.. ({len(missing)}) but reported {sorted(reported)[:10]}.. ({counted})"
    )


def _windows(path: Path) -> list[int]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10) as conn:
        return [r[0] for r in conn.execute("SELECT seq FROM records WHERE kind = 'window' ORDER BY seq")]


def _damage_index(path: Path) -> None:
    """Overwrite the records index's root page with junk: SQLite's integrity check fails, while
    every record (the table itself) stays readable, so all of them can be salvaged."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the pages must be in the main file
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'records_kind'").fetchone()
        page = conn.execute("PRAGMA page_size").fetchone()[0]
    with path.open("r+b") as fh:
        fh.seek((root - 1) * page)
        fh.write(b"\xa5" * page)


def test_kill9_in_an_outage_then_a_damaged_spool_continues_seq_and_session(tmp_path):
    work = tmp_path / "agent"
    work.mkdir()
    spool = work / "dev-1.spool.sqlite"
    log = tmp_path / "agent.log"
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        w = Watcher(broker.port)
        first = _agent(proxy.port, work, log)
        try:
            assert _session(first) == 1
            wait_for(lambda: len(w.seqs()) >= 3, 30, what="first run's windows")
            proxy.cut()
            wait_for(lambda: len(_windows(spool)) >= 25, 30, what="windows spooled in the outage")
        finally:
            _kill(first)
        held = _windows(spool)
        _damage_index(spool)
        proxy.heal()
        second = _agent(proxy.port, work, log)
        try:
            session = _session(second)
            wait_for(
                lambda: any(d["session"] == session and not d["historical"] for d in w.docs("tele/latency")),
                30,
                what="second run live",
            )
            wait_for(lambda: set(held) <= set(w.seqs()), 60, what="replay of the salvaged windows")
            wait_for(lambda: w.docs("evt/spool_drop"), 20, what="the corrupt-spool report")
            time.sleep(1.0)
        finally:
            _kill(second)
        time.sleep(0.3)
        docs = w.docs("tele/latency")
        reported, _counted = _reported(w)
        drops = [d["data"] for d in w.docs("evt/spool_drop")]
        w.close()
    assert list(work.glob("dev-1.spool.sqlite.corrupt-*")), "the damaged file is kept aside"
    first_new = min(d["seq"] for d in docs if d["session"] == session)
    missing = _missing_from(docs)
    print(
        f"\nsalvaged {len(held)} windows (seq {held[0]}-{held[-1]}); second run session {session}, "
        f"first seq {first_new}; missing {sorted(missing)}; reported {sorted(reported)}; drops {drops}"
    )
    assert session == 2, "the session goes up by one across a crash and a rebuilt spool"
    assert missing == reported, "every seq gap is announced with its exact range, and only those"
    assert first_new == held[-1] + 1, "seq continues right after the last salvaged window"


def _missing_from(docs: list[dict]) -> set[int]:
    seen = {d["seq"] for d in docs}
    return set(range(1, max(seen) + 1)) - seen


def test_a_start_on_a_full_disk_keeps_the_spool_and_runs_degraded_until_space_returns(tmp_path, small_disk):
    """A restart while the disk is still full: the agent must start (degraded), leave the intact spool
    where it is (not take it for damage), and replay what it holds once space returns."""
    log = tmp_path / "agent.log"
    spool = small_disk / "dev-1.spool.sqlite"
    with Broker(tmp_path / "b") as broker, TcpProxy(broker.port) as proxy:
        w = Watcher(broker.port)
        first = _agent(proxy.port, small_disk, log)
        try:
            assert _session(first) == 1
            wait_for(lambda: len(w.seqs()) >= 5, 30, what="first run's windows")
            proxy.cut()
            wait_for(lambda: len(_windows(spool)) >= 10, 30, what="windows spooled in an outage")
        finally:
            _kill(first)
        held = _windows(spool)
        proxy.heal()
        filler = _fill(small_disk)
        lines_before = _lines(log)
        second = _agent(proxy.port, small_disk, log)
        try:
            line = second.stdout.readline().strip()
            started = line.startswith("session ")
            degraded = False
            if started:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 10.0 and second.poll() is None:
                    degraded = degraded or any(d["state"] == "degraded" and d["session"] == 2 for d in w.docs("/state"))
                    time.sleep(0.2)
            lines_full = _lines(log) - lines_before
            aside = list(small_disk.glob("dev-1.spool.sqlite.corrupt-*"))
            filler.unlink()
            if started:
                wait_for(lambda: _states(w)[-1:] == ["online"], 30, what="online once space returned")
                wait_for(lambda: set(held) <= set(w.seqs()), 30, what="the first run's held windows replayed")
                wait_for(lambda: _missing(w) == _reported(w)[0], 30, what="the loss report")
        finally:
            _kill(second)
        missing, (reported, counted) = _missing(w), _reported(w)
        silent = _silent_losses(w, 0.1)
        w.close()
    print(
        f"\nstart on a full disk: {line!r}; {lines_full} log lines in 10 s; degraded {degraded}; "
        f"moved aside {[p.name for p in aside]}; missing {len(missing)}, reported {counted}"
    )
    assert started, f"the agent did not start on a full disk: {line!r} {log.read_text()[-2000:]}"
    assert line == "session 2"
    assert not aside, "an intact spool on a full disk is not damage"
    assert degraded and lines_full < MAX_LOG_LINES
    assert silent == 0 and reported == missing and counted == len(missing)
