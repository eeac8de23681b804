"""The state lock: one holder per state folder, its PID in the file, a second locker refused with that
PID and path, released on exit (kill -9 included: the kernel drops flock locks with the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edge_agent.config import Settings
from edge_agent.daemon.statelock import LOCK_NAME, AlreadyRunning, StateLock, read_holder, state_dirs

HOLD = textwrap.dedent("""
    import sys, time
    from edge_agent.daemon.statelock import StateLock
    StateLock([sys.argv[1]]).acquire()
    print("locked", flush=True)
    time.sleep(60)
""")


def holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_state_dirs_are_the_distinct_folders_of_spool_and_ledger(tmp_path):
    s = Settings(telemetry={"spool_path": tmp_path / "a" / "spool.sqlite", "ledger_path": tmp_path / "b" / "l.sqlite"})
    assert state_dirs(s) == [tmp_path / "a", tmp_path / "b"]
    s = Settings(telemetry={"spool_path": tmp_path / "spool.sqlite", "ledger_path": tmp_path / "ledger.sqlite"})
    assert state_dirs(s) == [tmp_path]


def test_the_holder_writes_its_pid_and_a_second_locker_is_refused_with_it(tmp_path):
    proc = holder(tmp_path / "state")
    try:
        path = tmp_path / "state" / LOCK_NAME
        assert read_holder(path) == proc.pid
        with pytest.raises(AlreadyRunning) as err:
            StateLock([tmp_path / "state"]).acquire()
        assert err.value.pid == proc.pid and err.value.path == path
        assert f"PID {proc.pid}" in str(err.value) and str(path) in str(err.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # kill -9 left no stale lock behind.
    with StateLock([tmp_path / "state"]) as lock:
        assert read_holder(lock.paths[0]) == os.getpid()


def test_a_refusal_on_the_second_folder_releases_the_first(tmp_path):
    proc = holder(tmp_path / "b")
    try:
        with pytest.raises(AlreadyRunning):
            StateLock([tmp_path / "a", tmp_path / "b"]).acquire()
        with StateLock([tmp_path / "a"]):  # "a" was released when "b" was refused
            pass
    finally:
        proc.kill()
        proc.wait(10)


def test_release_clears_the_pid_and_allows_the_next_holder(tmp_path):
    lock = StateLock([tmp_path]).acquire()
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""
    StateLock([tmp_path]).acquire().release()


def test_an_unwritable_state_folder_is_reported_with_its_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(Exception) as err:
        StateLock([blocker / "state"]).acquire()
    assert str(blocker / "state" / LOCK_NAME) in str(err.value)
