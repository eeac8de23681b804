"""``models fetch`` builds the engines of an LLM or Whisper recipe right after the import
(``build_recipe_engines``), the same build ``edge-agent build --recipe NAME`` runs, so the default tiers serve
the gate's engine from the first start; a model without a recipe, or with a one-graph speech recipe (a demo
recogniser's), is left as imported."""

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


def test_a_whisper_recipe_is_built_and_gated_as_an_llm_one_is(dirs, capsys) -> None:
    # the voice tier serves the Whisper engine the gate chose from its first start, as the LLM tiers do
    import wave

    import numpy as np

    from edge_agent.importers import import_model
    from tests import ct2_whisper_tiny as tiny

    pytest.importorskip("onnx")
    tiny.write_folder(dirs["models"].parent / "src", "float32")
    folder = import_model(
        dirs["models"].parent / "src", dirs["models"] / "imported" / "tiny-whisper", dirs["models"]
    ).path
    pcm = (np.random.default_rng(4).standard_normal(16000) * 3000).astype(np.int16)
    with wave.open(str(dirs["recipes"] / "u.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    (dirs["recipes"] / "heldout.jsonl").write_text(json.dumps({"audio": "u.wav", "text": "turn on the light"}) + "\n")
    recipe = (ROOT / "engines" / "whisper-base.toml").read_text()
    recipe = recipe.replace('name = "whisper-base"', 'name = "tiny-whisper"').replace(
        'model = "whisper-base"', f"model = {json.dumps(str(folder))}"
    )
    recipe = recipe.replace(
        '"../calibration/asr/voices-heldout.jsonl"', json.dumps(str(dirs["recipes"] / "heldout.jsonl"))
    )
    recipe = recipe.replace("samples = 144", "samples = 1").replace("max_wer_delta = 0.015", "max_wer_delta = 1.0")
    (dirs["recipes"] / "tiny-whisper.toml").write_text(recipe)
    assert build_recipe_engines("tiny-whisper", None, say=True) == 0
    err = capsys.readouterr().err
    assert "WER" in err and "chosen" in err  # the speech report's columns
    built = {e.manifest["key_parts"]["precision"] for e in EngineCache(dirs["engines"], 1 << 30).entries()}
    assert built == {"fp32", "int8"}  # the recipe's precisions, each within its (loose) gate, cached
