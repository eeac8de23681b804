"""The real Gemma 3 270M through ``edge-agent build`` (slow): its INT8 weight-only engine judged by the
perplexity gate, the decision checked against the recipe's own budget, never against this machine's
numbers. The recipe is the shipped one, scored on the text's first 1,024 tokens to keep the run short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.engines.recipes import load_recipe
from tests.gate_checks import assert_gate_decided

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two 1 GB models scored and timed on a small CPU
def test_int8w_of_the_real_model_is_gated_by_perplexity(gemma3_model: Path, tmp_path: Path) -> None:
    shipped = (ROOT / "engines/gemma-3-270m.toml").read_text()
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    calibration = ROOT / "calibration/llm"
    text = (
        shipped.replace("max_tokens = 4096", "max_tokens = 1024")
        .replace("../calibration/llm", str(calibration))
        .replace("samples = 8", "samples = 4")
    )
    assert (
        text.count(str(calibration)) == 4 and "max_tokens = 1024" in text
    )  # held-out, prompts, text, int4 calibration
    (recipes / "gemma-3-270m.toml").write_text(text)
    recipe = load_recipe(recipes / "gemma-3-270m.toml")
    env = {
        **os.environ,
        "EDGE_AGENT_ENGINES__CACHE_DIR": str(tmp_path / "engines"),
        "EDGE_AGENT_ENGINES__RECIPES_DIR": str(recipes),
        "EDGE_AGENT_MODELS__CACHE_DIR": str(gemma3_model.parent.parent),  # the name resolves to the fetched model
    }
    out = tmp_path / "report.json"
    cmd = ["build", "--recipe", "gemma-3-270m", "--target", "cpu", "--precision", "int8w", "--threads", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "edge_agent", *cmd, "--json", str(out), "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode in (0, 3), proc.stderr
    report = json.loads(out.read_text())
    (engine,) = report["engines"]
    acc = engine["accuracy"]
    m = acc["metrics"]
    assert engine["model"] == "gemma-3-270m" and engine["precision"] == "int8w"
    assert m["ppl_tokens"] == 1024 and m["perplexity"] > 1 and m["perplexity_fp32"] > 1
    rungs = {"": recipe.accuracy, **{f"{name}.": budget for name, budget in recipe.rungs.items()}}
    assert acc["budget"] == {  # the top rung's budget, and each lower rung's under its name
        f"{prefix}{key}": getattr(budget, key)
        for prefix, budget in rungs.items()
        for key in ("max_ppl_increase_pct", "min_greedy_agreement")
    }
    assert_gate_decided(acc, recipe.accuracy)
    assert proc.returncode == (0 if acc["passed"] else 3)
    row = next(r for r in report["rows"] if r["candidate"] == "onnxruntime/int8w")
    assert f"{m['ppl_increase_pct']:+.2f}%" in row["checks"]["ppl"]
    for reason in acc["reasons"]:
        assert f"{m['perplexity']:.4f}" in reason or f"{m['greedy_agreement']:.4f}" in reason
