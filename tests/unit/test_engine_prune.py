"""``engines prune`` on staging (refused builds, stale locks) and the daemon's serving record."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

from edge_agent.engines.cache import EngineCache, mark_step, staged_steps
from edge_agent.engines.serving_mark import record_serving, served_keys


def staged(cache: EngineCache, key: str, gate: dict | None, steps: tuple[str, ...] = ("reference",)) -> Path:
    with cache.staging(key) as path:
        (path / "work").mkdir(exist_ok=True)
        (path / "work" / "model.onnx").write_bytes(b"x" * 100)
        for step in steps:
            mark_step(path, step, {})
        if gate is not None:
            mark_step(path, "gate", gate)
    return path


def lock_in_child_and_exit(lock: Path) -> None:
    # A build that took the lock and died: flock is released with its process, the file stays.
    code = f"import fcntl; f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_prune_removes_refused_builds_and_keeps_resumable_ones(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path, 1 << 30)
    refused = staged(cache, "a" * 64, {"passed": False, "reasons": ["cosine 0.7 < 0.995"]})
    interrupted = staged(cache, "b" * 64, None, ("reference", "convert"))
    assert staged_steps(interrupted) == ["reference", "convert"]
    removed = cache.prune({}, {})
    assert removed["staging"] == ["a" * 64]
    assert not refused.exists() and not (cache.staging_dir / f"{'a' * 64}.lock").exists()
    assert interrupted.is_dir() and (cache.staging_dir / f"{'b' * 64}.lock").exists()  # the same command resumes it


def test_a_running_build_of_a_refused_key_is_left_alone(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path, 1 << 30)
    path = staged(cache, "c" * 64, {"passed": False, "reasons": []})
    with (cache.staging_dir / f"{'c' * 64}.lock").open("a") as held:  # a rebuild holds it now
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cache.prune({}, {})["staging"] == []
        assert path.is_dir()
    assert cache.prune({}, {})["staging"] == ["c" * 64]


def test_stale_lock_removed_live_lock_kept(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path, 1 << 30)
    cache.staging_dir.mkdir(parents=True)
    stale, live = cache.staging_dir / f"{'d' * 64}.lock", cache.staging_dir / f"{'e' * 64}.lock"
    lock_in_child_and_exit(stale)
    assert stale.exists()
    with live.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        removed = cache.prune({}, {})
        assert removed["locks"] == [stale.name]
        assert not stale.exists() and live.exists()


def test_serving_mark_follows_the_recording_process(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record_serving(tmp_path, "full", "k1", pid=child.pid)
        record_serving(tmp_path, "lite", None, pid=child.pid)  # a tier on its model folder marks nothing
        assert served_keys(tmp_path) == {"k1": ["full"]}
    finally:
        child.kill()
        child.wait(timeout=30)
    assert served_keys(tmp_path) == {}  # the daemon is gone: nothing is served any more
    record_serving(tmp_path, "full", "k2")  # a new daemon (this process) drops the dead one's records
    records = json.loads((tmp_path / "serving.json").read_text())
    assert set(records) == {"full"} and served_keys(tmp_path) == {"k2": ["full"]}


def test_unreadable_serving_record_means_nothing_served(tmp_path: Path) -> None:
    (tmp_path / "serving.json").write_text("{not json")
    assert served_keys(tmp_path) == {}
