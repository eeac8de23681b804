"""Where ``models import`` may write: a new folder, an empty one or an earlier import (replaced); never a file,
a folder of someone else's files, a path through a file, or anywhere outside the models cache by way of
``--name``. Each refusal is one line naming the path and what is allowed, and leaves everything as it was;
a disk that refuses writes (read-only, full) is one line too, with nothing left behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.errors import ModelError
from edge_agent.importers import import_model
from tests.conftest import REPO
from tests.gguf_files import TinyConfig, make_weights, spm_vocab, write_gguf

CFG = TinyConfig("llama", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, vocab=spm_vocab(), tied=True)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("src") / "tiny.gguf", CFG, make_weights(CFG))


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _cli(tmp_path: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env.update({"CACHE_DIRECTORY": str(tmp_path / "cache"), "STATE_DIRECTORY": str(tmp_path / "state")})
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "edge_agent", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def test_a_folder_of_other_files_is_refused_and_kept(tmp_path, gguf_file):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8 not really")
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    with pytest.raises(ModelError) as err:
        import_model(gguf_file, out, tmp_path / "cache")
    message = str(err.value)
    assert str(out) in message and "2 other entries" in message and "remove the folder first" in message
    assert _tree(tmp_path) == before


def test_a_regular_file_is_refused_and_kept(tmp_path, gguf_file):
    out = tmp_path / "report.txt"
    out.write_text("keep me")
    with pytest.raises(ModelError, match="exists and is not a folder"):
        import_model(gguf_file, out, tmp_path / "cache")
    assert out.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]  # no .report.txt.importing-old


def test_an_empty_folder_and_an_earlier_import_are_written(tmp_path, gguf_file):
    out = tmp_path / "model"
    out.mkdir()
    first = import_model(gguf_file, out, tmp_path / "cache")
    assert (first.path / "model.onnx").is_file()
    again = import_model(gguf_file, out, tmp_path / "cache")  # an earlier import: replaced
    assert again.path == out and (out / "import.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_path_through_a_file_is_one_line(tmp_path, gguf_file):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match=r"is a file, not a folder"):
        import_model(gguf_file, tmp_path / "file" / "model", tmp_path / "cache")
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    "name", ["../../victim", "..", ".", "/tmp/abs", "a/b", "", ".hidden", "-rf", "x" * 101, "a\nb", "ünï"]
)
def test_a_name_is_one_safe_path_component(tmp_path, gguf_file, name):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    cache = tmp_path / "a" / "b" / "cache"
    before = _tree(tmp_path)
    with pytest.raises(ModelError) as err:
        import_model(gguf_file, None, cache, name=name)
    assert "one path component" in str(err.value) and "\n" not in str(err.value)
    assert _tree(tmp_path) == before


def test_a_safe_name_is_addressable_under_the_cache(tmp_path, gguf_file):
    result = import_model(gguf_file, None, tmp_path / "cache", name="My_model-1.0")
    assert result.path == (tmp_path / "cache" / "imported" / "My_model-1.0").resolve()


def test_a_read_only_destination_is_one_line(tmp_path, gguf_file, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ModelError, match="Read-only file system") as err:
        import_model(gguf_file, tmp_path / "ro" / "model", tmp_path / "cache")
    assert str(tmp_path / "ro" / "model") in str(err.value)


def test_a_full_disk_mid_import_is_one_line_and_leaves_nothing(tmp_path, gguf_file, monkeypatch):
    import onnx

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model.onnx")

    monkeypatch.setattr(onnx, "save_model", full)
    out = tmp_path / "out"
    with pytest.raises(ModelError, match="No space left on device"):
        import_model(gguf_file, out / "model", tmp_path / "cache")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("source", ["gguf", "ct2-whisper"])
def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path, gguf_file, monkeypatch, source):
    import shutil

    from tests import ct2_whisper_tiny

    if source == "gguf":
        src = gguf_file
        # float32 weights (4 bytes per value the reference draws) and 64 MiB of headroom
        need = 4 * sum(w.size for w in make_weights(CFG).values()) + (64 << 20)
    else:
        src = tmp_path / "ct2"
        weights = ct2_whisper_tiny.write_folder(src, "float16")
        # float32 weights written twice (the embedding table is in both decoders' files) and 64 MiB of headroom
        need = 8 * sum(w.size for w in weights.values()) + (64 << 20)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    out = tmp_path / "out"
    with pytest.raises(ModelError) as err:
        import_model(src, out / "model", tmp_path / "cache")
    assert str(err.value) == f"{out}: 1 MiB free, the imported model needs {need / 2**20:,.0f} MiB"
    assert list(out.iterdir()) == []


def test_cli_refuses_each_with_one_line(tmp_path, gguf_file):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    (tmp_path / "file").write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    cases = [
        (["--name", "../../victim"], REPO, "one path component"),
        (["--name", ".."], REPO, "one path component"),
        (["--out", str(victim)], REPO, "1 other entry"),
        (["--out", str(tmp_path / "file")], REPO, "exists and is not a folder"),
        (["--out", str(tmp_path / "file" / "model")], REPO, "is a file, not a folder"),
        (["--out", "."], busy, "1 other entry"),
    ]
    for extra, cwd, said in cases:
        run = _cli(tmp_path, "models", "import", str(gguf_file), *extra, cwd=cwd)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and said in lines[0], (extra, run.stderr[-2000:])
        assert "use it as" not in run.stdout
    assert (victim / "keep.txt").read_text() == "keep" and (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in busy.iterdir()) == ["x"]
    empty = tmp_path / "empty"
    empty.mkdir()
    run = _cli(tmp_path, "models", "import", str(gguf_file), "--out", ".", cwd=empty)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (empty / "model.onnx").is_file()
