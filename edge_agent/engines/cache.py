"""The content-addressed engine cache.

    <cache_dir>/
      entries/<key>/           one built engine: its artifact files + manifest.json (+ last_used)
      staging/<key>/           a build in progress: partial files + steps/<step>.json markers (resume point)
      quarantine/<key>-<ts>/   entries whose files no longer match their manifest hashes
      timing/                  TensorRT timing caches, one per TensorRT version and device

The key is sha256 over the model bytes, the recipe, the precision, the shape profiles, the runtime
version and the device fingerprint (``cache_key``), so a runtime upgrade or another device gives a
new key; ``stale`` entries (other runtime or device) are what ``prune`` removes first.

Commit is crash-safe: files are written into ``staging/<key>``, fsynced, the manifest (with every
file's sha256) written last, then the folder is renamed into ``entries/``. Loading verifies the
hashes; a mismatch moves the entry to ``quarantine/`` and the caller rebuilds. The total size is
capped by ``max_bytes``: least-recently-used entries are evicted after each commit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SCHEMA = "edge-agent/engine-manifest/1"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """The file's sha256. Its pages are then dropped from the page cache (unless something maps them): a
    sequential read leaves them in large folios, and a runtime that maps the file (ONNX Runtime's external
    data) would then have whole folios resident for each row it touches (an embedding table's rows:
    +84 MB peak RSS for a Gemma 3 270M engine), where pages faulted in by the runtime itself stay small."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            h.update(block)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return h.hexdigest()


def hash_model(folder: Path, memo: Path | None = None) -> str:
    """sha256 over every file of a model folder (names and bytes, sorted), i.e. the model's identity.

    ``memo`` (a JSON file) remembers each file's hash by path, size and mtime: a multi-GB export is
    read once, not on every build."""
    known: dict[str, Any] = {}
    if memo is not None and memo.is_file():
        try:
            known = json.loads(memo.read_text())
        except (OSError, json.JSONDecodeError):
            known = {}
    h = hashlib.sha256()
    changed = False
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = path.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        record = known.get(str(path))
        if not (isinstance(record, list) and record[0] == stamp):
            record = [stamp, sha256_file(path)]
            known[str(path)] = record
            changed = True
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(bytes.fromhex(record[1]))
    if memo is not None and changed:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    return h.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    """The entry key: sha256 of the canonical JSON of ``parts`` (model hash, recipe, precision, ...)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Entry:
    """One committed engine in the cache: its key, folder, manifest, size and last use."""

    key: str
    path: Path
    manifest: dict[str, Any]
    size_bytes: int
    last_used: float

    @property
    def artifact(self) -> Path:
        return self.path / self.manifest["artifact"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):  # files before the folders holding them
        if path.is_file():
            with path.open("rb+") as fh:
                os.fsync(fh.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(root)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class EngineCache:
    """The content-addressed engine cache (see the module doc): staged, verified, LRU-bounded."""

    def __init__(self, root: Path, max_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self.clock = clock
        self.entries_dir = self.root / "entries"
        self.staging_dir = self.root / "staging"
        self.quarantine_dir = self.root / "quarantine"
        self.timing_dir = self.root / "timing"

    # -- building --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        """The staging folder of ``key``, locked against a second build of the same key.

        It is kept after a failure or interruption: the next build resumes from its step markers."""
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        lock_path = self.staging_dir / f"{key}.lock"
        with lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise EngineError(f"another build of this engine ({key[:12]}) is running; wait for it") from None
            path = self.staging_dir / key
            path.mkdir(exist_ok=True)
            yield path

    def commit(self, key: str, staged: Path, manifest: dict[str, Any]) -> Entry:
        """Hash, fsync and atomically publish ``staged`` as the entry ``key``; then evict to the size cap."""
        files = {}
        for path in sorted(p for p in staged.rglob("*") if p.is_file()):
            rel = str(path.relative_to(staged))
            if rel.startswith("steps/") or rel == MANIFEST:
                continue
            files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        shutil.rmtree(staged / "steps", ignore_errors=True)
        if manifest.get("artifact") not in files and not (staged / str(manifest.get("artifact"))).is_dir():
            raise EngineError(f"build produced no {manifest.get('artifact')!r} in {staged}")
        doc = {"schema": SCHEMA, "key": key, **manifest, "files": files, "committed_at": self.clock()}
        tmp = staged / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
        os.replace(tmp, staged / MANIFEST)
        _fsync_tree(staged)
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        final = self.entries_dir / key
        if final.exists():  # a verified-bad or forced rebuild: the old one goes
            self._quarantine_path(final, "replaced by a rebuild")
        os.rename(staged, final)
        _fsync_dir(self.entries_dir)
        self._touch(final)
        self.evict(keep={key})
        return self._entry(final)

    # -- loading ---------------------------------------------------------------------------------

    def lookup(self, key: str, verify: bool = True) -> Entry | None:
        """The entry for ``key`` if present and intact (hashes checked), else None (a bad one is quarantined)."""
        path = self.entries_dir / key
        if not (path / MANIFEST).is_file():
            return None
        if verify:
            problems = self.verify_entry(path)
            if problems:
                log.warning(
                    "engine %s failed verification (%s); quarantined, it will be rebuilt", key[:12], "; ".join(problems)
                )
                self._quarantine_path(path, "; ".join(problems))
                return None
        self._touch(path)
        return self._entry(path)

    def verify_entry(self, path: Path) -> list[str]:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return [f"manifest unreadable: {exc}"]
        problems = []
        if manifest.get("key") != path.name:
            problems.append(f"manifest key {str(manifest.get('key'))[:12]} is not the folder's {path.name[:12]}")
        for rel, info in manifest.get("files", {}).items():
            file = path / rel
            if not file.is_file():
                problems.append(f"{rel} missing")
            elif file.stat().st_size != info["bytes"]:
                problems.append(f"{rel} is {file.stat().st_size} bytes, expected {info['bytes']}")
            elif sha256_file(file) != info["sha256"]:
                problems.append(f"{rel} sha256 mismatch")
        return problems

    def entries(self) -> list[Entry]:
        if not self.entries_dir.is_dir():
            return []
        out = []
        for path in sorted(self.entries_dir.iterdir()):
            if (path / MANIFEST).is_file():
                try:
                    out.append(self._entry(path))
                except (OSError, json.JSONDecodeError, KeyError) as exc:
                    log.warning("unreadable cache entry %s: %s", path.name, exc)
        return out

    def find(
        self, model_name: str, backend: str, precision: str | None, runtime_version: str | None, device: str
    ) -> Entry | None:
        """The engine a serving tier should load: a current entry (this runtime version and device) of
        ``model_name`` on ``backend``; for ``precision`` None ("auto"), the one the gate's rule picks
        (fastest passing; INT8/INT4 only if faster than FP32/FP16)."""
        from .gate import Verdict, choose

        candidates = [
            e
            for e in self.entries()
            if e.manifest.get("model_name") == model_name
            and e.manifest.get("backend") == backend
            and e.manifest.get("device") == device
            and e.manifest.get("runtime_version") == runtime_version
            and (precision is None or e.manifest.get("precision") == precision)
        ]
        if not candidates:
            return None
        verdicts = {}
        for e in candidates:
            acc = e.manifest.get("accuracy") or {}
            verdicts[e.key] = Verdict(
                str(e.manifest.get("precision")),
                backend,
                acc.get("metrics", {}),
                {},
                bool(acc.get("passed", True)),
                [],
                acc.get("latency_ms"),
                rungs=dict(acc.get("rungs") or {}),
            )
        best = choose(list(verdicts.values()))  # the top rung's
        key = next((k for k, v in verdicts.items() if v is best), None)
        entry = next((e for e in candidates if e.key == key), None) if key else None
        return self.lookup(entry.key) if entry else None

    # -- housekeeping ----------------------------------------------------------------------------

    def quarantine(self, key: str, reason: str) -> Path | None:
        path = self.entries_dir / key
        return self._quarantine_path(path, reason) if path.exists() else None

    def _quarantine_path(self, path: Path, reason: str) -> Path:
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        dest = self.quarantine_dir / f"{path.name}-{int(self.clock() * 1000)}"
        os.rename(path, dest)
        (dest / "QUARANTINED").write_text(reason + "\n")
        return dest

    def evict(self, keep: Set[str] = frozenset()) -> list[str]:
        """Remove least-recently-used entries until the cache fits ``max_bytes``; returns removed keys."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.size_bytes for e in entries)
        removed = []
        for entry in entries:
            if total <= self.max_bytes:
                break
            if entry.key in keep:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            total -= entry.size_bytes
            removed.append(entry.key)
            log.info(
                "engine cache: evicted %s (%s, %.1f MB) to stay under %.0f MB",
                entry.key[:12],
                entry.manifest.get("recipe_name"),
                entry.size_bytes / 1e6,
                self.max_bytes / 1e6,
            )
        return removed

    def stale(self, runtime_versions: Mapping[str, str | None], devices: Mapping[str, str]) -> list[Entry]:
        """Entries built for another runtime version (or a runtime not installed here) or another device.

        ``devices`` maps a target (cpu, jetson, intel-npu) to this machine's fingerprint for it."""
        out = []
        for e in self.entries():
            m = e.manifest
            if runtime_versions.get(str(m.get("runtime"))) != m.get("runtime_version") or devices.get(
                m.get("target", "cpu")
            ) != m.get("device"):
                out.append(e)
        return out

    def prune(
        self, runtime_versions: Mapping[str, str | None], devices: Mapping[str, str], everything: bool = False
    ) -> dict[str, list]:
        """Remove stale entries, quarantined ones, staging folders of refused builds and locks no
        build holds (``everything``: every entry and staging folder); returns what went, by kind.

        A staging folder of an interrupted build that was not refused is kept: the same command resumes it."""
        removed: dict[str, list] = {"stale": [], "quarantine": [], "staging": [], "locks": [], "all": []}
        for e in self.entries() if everything else self.stale(runtime_versions, devices):
            shutil.rmtree(e.path, ignore_errors=True)
            removed["all" if everything else "stale"].append(e.key)
        if self.quarantine_dir.is_dir():
            for p in sorted(self.quarantine_dir.iterdir()):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                    removed["quarantine"].append(p.name)
        if self.staging_dir.is_dir():
            for p in sorted(self.staging_dir.iterdir()):
                if p.is_dir() and (everything or staged_refused(p)) and self._remove_unlocked(p.name, p):
                    removed["staging"].append(p.name)
            for lock in sorted(self.staging_dir.glob("*.lock")):
                if not (self.staging_dir / lock.stem).is_dir() and self._remove_unlocked(lock.stem, None):
                    removed["locks"].append(lock.name)
        removed["evicted"] = self.evict()
        return removed

    def _remove_unlocked(self, key: str, folder: Path | None) -> bool:
        """Remove ``folder`` and the lock of ``key`` unless a build holds it (flock dies with its holder)."""
        lock_path = self.staging_dir / f"{key}.lock"
        if not lock_path.exists():
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            return True
        with lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a build is running on it
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
        return True

    def _touch(self, path: Path) -> None:
        (path / "last_used").write_text(f"{self.clock():.6f}\n")

    def _entry(self, path: Path) -> Entry:
        manifest = json.loads((path / MANIFEST).read_text())
        try:
            last_used = float((path / "last_used").read_text())
        except (OSError, ValueError):
            last_used = float(manifest.get("committed_at", 0))
        return Entry(path.name, path, manifest, _dir_size(path), last_used)


# -- step markers: how an interrupted build resumes ---------------------------------------------

STEPS = ("reference", "convert", "compile", "gate")  # in the order a build runs them


def staged_steps(staged: Path) -> list[str]:
    """The build steps an interrupted build of ``staged`` has finished, in order."""
    return [s for s in STEPS if (staged / "steps" / f"{s}.json").is_file()]


def staged_refused(staged: Path) -> bool:
    """True when the build staged in ``staged`` finished its gate step and was refused by it."""
    return (step_done(staged, "gate") or {}).get("passed") is False


def step_done(staged: Path, step: str) -> dict[str, Any] | None:
    """The saved result of ``step`` if an earlier run finished it, else None."""
    marker = staged / "steps" / f"{step}.json"
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def mark_step(staged: Path, step: str, result: dict[str, Any]) -> None:
    """Record ``step`` as finished (after its files are fsynced), atomically."""
    folder = staged / "steps"
    folder.mkdir(exist_ok=True)
    _fsync_tree(staged)
    tmp = folder / f"{step}.json.tmp"
    tmp.write_text(json.dumps(result, default=str))
    with tmp.open("rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, folder / f"{step}.json")
