"""Which tiers get the in-place FP32 recipe made for a plain export, and what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.config import TierConfig
from edge_agent.engines.plain_export_recipe import plain_export_recipe, recipe_name
from edge_agent.shipped import calibration_dir


def export(tmp: Path, model_type: str = "phi3", genai: bool = False) -> Path:
    folder = tmp / f"export-{model_type}{'-genai' if genai else ''}"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"graph")
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if genai:
        (folder / "genai_config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("model_type", ["phi3", "gemma", "gemma2"])
def test_a_plain_decoder_export_on_the_cpu_gets_one_fp32_inplace_recipe(tmp_path: Path, model_type: str) -> None:
    folder = export(tmp_path, model_type)
    recipe = plain_export_recipe(TierConfig(name="t", model=str(folder)))
    assert recipe is not None
    assert recipe.model == str(folder.resolve())
    assert (recipe.workload, recipe.targets, recipe.precisions, recipe.kv_layout) == (
        "llm",
        ["cpu"],
        ["fp32"],
        "inplace",
    )
    assert (
        recipe.heldout is not None
        and recipe.resolve(recipe.heldout.data) == calibration_dir() / "llm" / "heldout.jsonl"
    )
    assert recipe.resolve(recipe.heldout.data).is_file()


def test_other_tiers_get_none(tmp_path: Path) -> None:
    plain = export(tmp_path)
    assert plain_export_recipe(TierConfig(name="t", model="demo-phi3")) is None  # demo names ship recipes
    assert plain_export_recipe(TierConfig(name="t", model=str(export(tmp_path, genai=True)))) is None
    assert plain_export_recipe(TierConfig(name="t", model=str(export(tmp_path, "llama")))) is None
    assert plain_export_recipe(TierConfig(name="t", model=str(plain), backend="openvino")) is None
    assert plain_export_recipe(TierConfig(name="t", model=str(plain), backend="tensorrt", device="cuda")) is None
    assert plain_export_recipe(TierConfig(name="t", model=str(tmp_path / "missing"))) is None


def test_names_are_valid_recipe_names_and_differ_per_folder(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "Phi 3 (mini)!", tmp_path / "b" / "Phi 3 (mini)!"
    na, nb = recipe_name(a), recipe_name(b)
    assert na.startswith("inplace-Phi-3-mini-") and na != nb and recipe_name(a) == na
