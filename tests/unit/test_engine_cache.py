"""The content-addressed engine cache: atomic commit, verification + quarantine, LRU, staleness, resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edge_agent.engines.cache import EngineCache, cache_key, hash_model, mark_step, step_done
from edge_agent.errors import EngineError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manifest(**extra) -> dict:
    return {
        "artifact": "model",
        "runtime": "onnxruntime",
        "runtime_version": "1.32.0",
        "target": "cpu",
        "device": "cpu:x86_64:test",
        "recipe_name": "r",
        **extra,
    }


def build(cache: EngineCache, key: str, size: int = 1000, **extra):
    with cache.staging(key) as staged:
        (staged / "model").mkdir(exist_ok=True)
        (staged / "model" / "model.onnx").write_bytes(os.urandom(size))
        return cache.commit(key, staged, manifest(**extra))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(tmp_path: Path, clock: Clock) -> EngineCache:
    return EngineCache(tmp_path / "engines", max_bytes=10_000_000, clock=clock)


def test_key_changes_with_every_part() -> None:
    base = {
        "model": "m",
        "recipe": {"a": 1},
        "precision": "int8",
        "profiles": [1],
        "runtime_version": "1",
        "device": "d",
    }
    keys = {cache_key(base)}
    for part, value in [
        ("model", "m2"),
        ("recipe", {"a": 2}),
        ("precision", "fp16"),
        ("profiles", [2]),
        ("runtime_version", "2"),
        ("device", "e"),
    ]:
        keys.add(cache_key({**base, part: value}))
    assert len(keys) == 7
    assert cache_key(dict(reversed(list(base.items())))) == cache_key(base)  # order-free


def test_hash_model_covers_names_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1")
    first = hash_model(tmp_path)
    (tmp_path / "a").write_bytes(b"2")
    second = hash_model(tmp_path)
    (tmp_path / "a").rename(tmp_path / "b")
    assert len({first, second, hash_model(tmp_path)}) == 3


def test_hash_memo_skips_unchanged_files_and_sees_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_agent.engines.cache as cache_mod

    folder, memo = tmp_path / "m", tmp_path / "memo.json"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"weights")
    first = hash_model(folder, memo)
    reads = []
    real = cache_mod.sha256_file
    monkeypatch.setattr(cache_mod, "sha256_file", lambda p: reads.append(p) or real(p))
    assert hash_model(folder, memo) == first and reads == []
    (folder / "w.bin").write_bytes(b"changed")
    assert hash_model(folder, memo) != first and len(reads) == 1


def test_commit_then_lookup_round_trip(cache: EngineCache) -> None:
    entry = build(cache, "k1")
    assert entry.path == cache.entries_dir / "k1"
    assert not (cache.staging_dir / "k1").exists()  # renamed, not copied
    doc = json.loads((entry.path / "manifest.json").read_text())
    assert doc["key"] == "k1" and set(doc["files"]) == {"model/model.onnx"}
    assert len(doc["files"]["model/model.onnx"]["sha256"]) == 64
    found = cache.lookup("k1")
    assert found is not None and found.artifact == entry.path / "model"
    assert cache.lookup("missing") is None


def test_a_tampered_entry_is_quarantined_and_not_returned(cache: EngineCache) -> None:
    entry = build(cache, "k1")
    with (entry.path / "model" / "model.onnx").open("r+b") as fh:
        first = fh.read(1)[0]
        fh.seek(0)
        fh.write(bytes([first ^ 0xFF]))  # same size, different bytes (writing a fixed b"X" over random bytes
        # changed nothing one time in 256: the first byte was an "X" already)
    assert cache.lookup("k1") is None
    assert not entry.path.exists()
    [moved] = list(cache.quarantine_dir.iterdir())
    assert "sha256 mismatch" in (moved / "QUARANTINED").read_text()


def test_a_truncated_or_missing_file_fails_verification(cache: EngineCache) -> None:
    entry = build(cache, "k1")
    (entry.path / "model" / "model.onnx").write_bytes(b"short")
    assert any("bytes, expected" in p for p in cache.verify_entry(entry.path))
    (entry.path / "model" / "model.onnx").unlink()
    assert cache.verify_entry(entry.path) == ["model/model.onnx missing"]


def test_commit_refuses_a_build_without_its_artifact(cache: EngineCache) -> None:
    with cache.staging("k1") as staged, pytest.raises(EngineError, match="no 'model'"):
        cache.commit("k1", staged, manifest())


def test_lru_eviction_keeps_the_cache_under_its_cap(tmp_path: Path, clock: Clock) -> None:
    cache = EngineCache(tmp_path / "e", max_bytes=25_000, clock=clock)
    build(cache, "old", 10_000)
    clock.now += 10
    build(cache, "mid", 10_000)
    clock.now += 10
    assert cache.lookup("old") is not None  # touching makes "old" recent, "mid" the LRU
    clock.now += 10
    build(cache, "new", 10_000)
    assert sorted(e.key for e in cache.entries()) == ["new", "old"]


def test_the_entry_just_built_is_never_evicted(tmp_path: Path, clock: Clock) -> None:
    cache = EngineCache(tmp_path / "e", max_bytes=1024 * 1024)
    cache.max_bytes = 5_000
    build(cache, "huge", 20_000)
    assert [e.key for e in cache.entries()] == ["huge"]


def test_stale_entries_by_runtime_version_and_device(cache: EngineCache) -> None:
    build(cache, "current")
    build(cache, "old-ort", runtime_version="1.18.0")
    build(cache, "other-cpu", device="cpu:aarch64:other")
    build(cache, "jetson", target="jetson", device="cuda:Orin:sm_87:R36", runtime="tensorrt", runtime_version="10.3")
    versions = {"onnxruntime": "1.32.0", "tensorrt": "10.3"}
    devices = {"cpu": "cpu:x86_64:test", "jetson": "cuda:Orin:sm_87:R36"}
    assert sorted(e.key for e in cache.stale(versions, devices)) == ["old-ort", "other-cpu"]
    removed = cache.prune(versions, devices)
    assert sorted(removed["stale"]) == ["old-ort", "other-cpu"]
    assert sorted(e.key for e in cache.entries()) == ["current", "jetson"]
    assert cache.prune(versions, devices, everything=True)["all"] == ["current", "jetson"]
    assert cache.entries() == []


def test_prune_empties_the_quarantine(cache: EngineCache) -> None:
    build(cache, "k1")
    cache.quarantine("k1", "test")
    assert cache.prune({}, {})["quarantine"]
    assert list(cache.quarantine_dir.iterdir()) == []


def test_staging_survives_an_interruption_and_resumes(cache: EngineCache) -> None:
    with pytest.raises(KeyboardInterrupt), cache.staging("k1") as staged:
        (staged / "work.bin").write_bytes(b"half")
        mark_step(staged, "convert", {"seconds": 1.5})
        raise KeyboardInterrupt
    with cache.staging("k1") as staged:
        assert step_done(staged, "convert") == {"seconds": 1.5}
        assert step_done(staged, "gate") is None
        assert (staged / "work.bin").read_bytes() == b"half"
        (staged / "model").mkdir()
        (staged / "model" / "x").write_bytes(b"1")
        entry = cache.commit("k1", staged, manifest())
    assert not (entry.path / "steps").exists()  # markers are build state, not engine content


def test_a_second_build_of_the_same_key_is_refused_while_one_runs(cache: EngineCache) -> None:
    with cache.staging("k1"), pytest.raises(EngineError, match="another build"), cache.staging("k1"):
        pass
    with cache.staging("k1"):  # released afterwards
        pass


def test_rebuilding_an_existing_key_replaces_it(cache: EngineCache) -> None:
    build(cache, "k1", 100)
    entry = build(cache, "k1", 200)
    assert entry.manifest["files"]["model/model.onnx"]["bytes"] == 200
    assert cache.lookup("k1") is not None


def test_find_picks_the_engine_a_tier_should_load(cache: EngineCache) -> None:
    def engine(key: str, precision: str, ms: float, passed: bool = True, **extra) -> None:
        build(
            cache,
            key,
            model_name="demo-asr",
            backend="onnxruntime",
            precision=precision,
            accuracy={"passed": passed, "latency_ms": ms, "metrics": {}},
            **extra,
        )

    engine("fp32", "fp32", 10.0)
    engine("int8-slow", "int8", 12.0)
    engine("fp16", "fp16", 9.0, passed=False)
    engine("int8-old", "int8", 1.0, runtime_version="1.18.0")
    find = lambda precision: cache.find("demo-asr", "onnxruntime", precision, "1.32.0", "cpu:x86_64:test")  # noqa: E731
    assert find(None).key == "fp32"  # INT8 measured slower: FP32; the refused and the stale never
    assert find("int8").key == "int8-slow"
    assert find("fp16") is None
    assert cache.find("demo-asr", "openvino", None, "2026.4", "cpu:x86_64:test") is None


def test_device_fingerprints() -> None:
    from edge_agent.engines.fingerprint import cpu_fingerprint, jetson_fingerprint

    info = "processor\t: 0\nmodel name\t: Intel(R) Core(TM) Ultra 7 155H\nflags\t\t: fpu avx avx2 fma avx_vnni sse4_2\n"
    assert cpu_fingerprint(info, "x86_64") == "cpu:x86_64:Intel(R) Core(TM) Ultra 7 155H:avx,avx2,fma,avx_vnni"
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd42\n"
    assert cpu_fingerprint(arm, "aarch64") == "cpu:aarch64:unknown:asimd,asimddp"
    orin = jetson_fingerprint("Orin", (8, 7), "# R36 (release), REVISION: 4.0")
    assert orin == "cuda:Orin:sm_87:# R36 (release), REVISION: 4.0"
    assert jetson_fingerprint("Orin", (8, 7), "# R36 (release), REVISION: 4.3") != orin  # JetPack upgrade: new key
