"""Regenerate a demo model's external weights (model.onnx.data) from its weights.json recipe.

demo-phi3-small's weights (115 MB of fp32) are not committed: its folder holds the ONNX graph, whose large
initializers point into model.onnx.data, and weights.json, which says for each of them where it lies in that
file and how to draw it with numpy. This module writes the file, streaming one tensor at a time, and checks
the result against the recorded sha256. Only numpy and the standard library: the runtime never needs torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

RECIPE = "weights.json"
_STAMP = ".materialized"  # holds the sha256 of the data file once it has been written and verified


def load_recipe(src_dir: Path) -> dict[str, Any]:
    recipe = json.loads((Path(src_dir) / RECIPE).read_text(encoding="utf-8"))
    if recipe.get("format") != 1:
        raise ValueError(f"{src_dir}/{RECIPE}: unsupported recipe format {recipe.get('format')!r}")
    return recipe


def _tensor(spec: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype(spec["dtype"])
    shape = tuple(spec["shape"])
    if spec["init"] == "normal":
        values = np.random.default_rng(spec["seed"]).standard_normal(shape, dtype=np.float32)
        values *= np.float32(spec["std"])
        return values.astype(dtype, copy=False)
    if spec["init"] in ("zeros", "ones"):
        return (np.zeros if spec["init"] == "zeros" else np.ones)(shape, dtype=dtype)
    raise ValueError(f"tensor {spec['name']!r}: unknown init {spec['init']!r}")


def _chunks(recipe: dict[str, Any]) -> Iterator[bytes]:
    """The data file's bytes in order: zero padding up to each recorded offset, then the tensor."""
    position = 0
    for spec in sorted(recipe["tensors"], key=lambda t: t["offset"]):
        if spec["offset"] < position:
            raise ValueError(f"tensor {spec['name']!r} overlaps the previous one at offset {spec['offset']}")
        if spec["offset"] > position:
            yield bytes(spec["offset"] - position)
        data = _tensor(spec).tobytes()
        if len(data) != spec["length"]:
            raise ValueError(f"tensor {spec['name']!r}: {len(data)} bytes generated, {spec['length']} recorded")
        yield data
        position = spec["offset"] + spec["length"]
    if recipe["data_bytes"] < position:
        raise ValueError(f"data_bytes {recipe['data_bytes']} is smaller than the tensors' extent {position}")
    if recipe["data_bytes"] > position:
        yield bytes(recipe["data_bytes"] - position)


def recipe_sha256(recipe: dict[str, Any]) -> str:
    """sha256 of the data file the recipe describes, computed without writing it."""
    digest = hashlib.sha256()
    for chunk in _chunks(recipe):
        digest.update(chunk)
    return digest.hexdigest()


def is_materialized(src_dir: Path, dst_dir: Path) -> bool:
    """True when dst_dir already holds data verified against this recipe (cheap: no hashing)."""
    recipe = load_recipe(src_dir)
    dst_dir = Path(dst_dir)
    data, stamp = dst_dir / recipe["file"], dst_dir / _STAMP
    return (
        data.is_file()
        and stamp.is_file()
        and data.stat().st_size == recipe["data_bytes"]
        and stamp.read_text().strip() == recipe["data_sha256"]
        and (dst_dir / "model.onnx").is_file()
    )


def materialize(src_dir: Path, dst_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Copy src_dir's files to dst_dir and write the external data file; returns dst_dir.

    progress(done_bytes, total_bytes) is called after each tensor. The data goes to a temporary file that
    replaces the target only after its sha256 matched; a mismatch raises ValueError and leaves nothing behind.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    recipe = load_recipe(src_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    total, expected = int(recipe["data_bytes"]), recipe["data_sha256"]
    target = dst_dir / recipe["file"]
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, done = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for chunk in _chunks(recipe):
                f.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
            f.flush()
            os.fsync(f.fileno())
        if done != total or digest.hexdigest() != expected:
            raise ValueError(
                f"{src_dir.name}: regenerated weights do not match weights.json ({done} bytes, sha256 "
                f"{digest.hexdigest()}; expected {total} bytes, sha256 {expected}). The numpy random generator "
                f"(numpy {np.__version__}) may draw differently from the one that made the recipe."
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    # The small files go last, model.onnx at the very end: a folder with a model.onnx is complete.
    for path in sorted(src_dir.iterdir(), key=lambda p: p.name == "model.onnx"):
        if path.is_file() and path.name != recipe["file"]:
            part = dst_dir / f".{path.name}.tmp"
            shutil.copyfile(path, part)
            os.replace(part, dst_dir / path.name)
    (dst_dir / _STAMP).write_text(expected + "\n")
    return dst_dir
