"""``models fetch`` builds the engines of an LLM recipe right after the import (``build_recipe_engines``), the
same build ``edge-agent build --recipe NAME`` runs, so the default tiers serve the gate's engine from the
first start; a model without a recipe, or with a speech recipe, is left as imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.cli.models import build_recipe_engines
from edge_agent.engines.cache import EngineCache

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
name = "{name}"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32"]
[heldout]
data = "{heldout}"
samples = 2
[accuracy]
min_cosine = 0.9
min_top1 = 0.5
max_kl = 0.5
"""


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    out = {k: tmp_path / k for k in ("recipes", "engines", "models")}
    out["recipes"].mkdir()
    monkeypatch.setenv("EDGE_AGENT_ENGINES__RECIPES_DIR", str(out["recipes"]))
    monkeypatch.setenv("EDGE_AGENT_ENGINES__CACHE_DIR", str(out["engines"]))
    monkeypatch.setenv("EDGE_AGENT_MODELS__CACHE_DIR", str(out["models"]))
    monkeypatch.setenv("EDGE_AGENT_DEVICE__THREADS", "1")
    return out


def test_an_llm_recipe_is_built_and_gated_and_a_second_call_finds_it_cached(dirs, capsys) -> None:
    heldout = ROOT / "calibration/llm/heldout.jsonl"
    (dirs["recipes"] / "tiny-home.toml").write_text(RECIPE.format(name="tiny-home", heldout=heldout))
    assert build_recipe_engines("tiny-home", None, say=True) == 0
    err = capsys.readouterr().err
    assert "building the engines of recipe 'tiny-home'" in err
    assert "onnxruntime/fp32" in err and "chosen" in err  # the build's report, as `edge-agent build` prints it
    entries = EngineCache(dirs["engines"], 1 << 30).entries()
    assert [e.manifest["key_parts"]["precision"] for e in entries] == ["fp32"]
    assert build_recipe_engines("tiny-home", None, say=False) == 0  # cached: a hit, nothing built again
    assert [e.key for e in EngineCache(dirs["engines"], 1 << 30).entries()] == [entries[0].key]


def test_a_model_without_an_llm_recipe_is_left_as_imported(dirs) -> None:
    assert build_recipe_engines("no-such-model", None) == 0
    speech = json.dumps(str(ROOT / "calibration/asr/heldout.jsonl"))
    (dirs["recipes"] / "tiny-asr.toml").write_text(
        f'name = "tiny-asr"\nmodel = "demo-asr"\nworkload = "asr"\ntargets = ["cpu"]\nprecisions = ["fp32"]\n'
        f"[heldout]\ndata = {speech}\n"
    )
    assert build_recipe_engines("tiny-asr", None) == 0
    assert not dirs["engines"].exists() or not EngineCache(dirs["engines"], 1 << 30).entries()
