"""Real TensorRT builds (``edge-agent build --target jetson``) behind the ``gpu`` marker.

Skipped with a reason where there is no GPU or no TensorRT (TensorRT comes from JetPack, not PyPI).
Each build runs as the user runs it, in a child process: a TensorRT fault cannot take pytest down.
The assertions are the CPU tests' ones: a gated engine per precision, two profiles for the LLM,
a reused timing cache on the second build, and INT8 from the symmetric Q/DQ graph.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.test_tensorrt_real import _need_tensorrt
from tests.integration.test_build_onnxruntime import make_recipe

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def build(tmp_path: Path, precision: str) -> dict:
    env = {
        **os.environ,
        "EDGE_AGENT_ENGINES__CACHE_DIR": str(tmp_path / "engines"),
        "EDGE_AGENT_MODELS__CACHE_DIR": str(tmp_path / "models"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "build",
            "--recipe",
            str(tmp_path / "tiny-phi3.toml"),
            "--target",
            "jetson",
            "--precision",
            precision,
            "--quiet",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)["engines"][0]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_tensorrt_engine_is_built_gated_and_cached(tmp_path: Path, precision: str) -> None:
    _need_tensorrt()
    make_recipe(tmp_path)
    report = build(tmp_path, precision)
    assert report["cache"] == "built" and report["backend"] == "tensorrt"
    compiled = report["compile"]
    assert compiled["profiles"] == ["prefill", "decode"]
    if precision == "int8":
        assert compiled["strongly_typed"] and compiled["builder_flags"] == []
    assert report["accuracy"]["passed"], report["accuracy"]["reasons"]
    again = build(tmp_path, precision)
    assert again["cache"] == "hit" and again["load_ms"] is not None


def test_second_build_reuses_the_timing_cache(tmp_path: Path) -> None:
    _need_tensorrt()
    make_recipe(tmp_path)
    build(tmp_path, "fp32")
    second = build(tmp_path, "fp16")
    assert second["compile"]["timing_cache_reused"]
