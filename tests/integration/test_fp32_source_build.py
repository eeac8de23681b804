"""An ONNX Runtime FP32 build of a plain export is the FP32 source itself: the gate runs its held-out
samples (the engine opens and answers) but takes the reference's perplexity instead of scoring the same
model again, and its speed is timed once for both columns; a weight-only build beside it is still
measured in full against that reference. A spy counts the real perplexity runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engines import perplexity_gate
from edge_agent.engines.cache import EngineCache
from edge_agent.engines.pipeline import BuildRequest, GateRefused, Heartbeat, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.systemd import Notifier

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
name = "tiny-ppl"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int8w"]
kv_layout = "plain"
[heldout]
data = "{heldout}"
samples = 2
[perplexity]
data = "{text}"
max_tokens = 96
window = 48
stride = 24
chunk = 24
[accuracy]
max_ppl_increase_pct = 50.0
min_greedy_agreement = 0.1
"""


def test_the_fp32_source_is_measured_once_as_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "README.md").read_text()[:4000])
    path = tmp_path / "tiny-ppl.toml"
    path.write_text(RECIPE.format(heldout=ROOT / "calibration/llm/heldout.jsonl", text=text))
    measured: list[str] = []
    real = perplexity_gate.measure

    def spy(recipe, ref, handle, tick=None):
        measured.append(recipe.name)
        return real(recipe, ref, handle, tick)

    monkeypatch.setattr(perplexity_gate, "measure", spy)
    pipe = Pipeline(
        load_recipe(path),
        EngineCache(tmp_path / "engines", 1 << 30),
        tmp_path / "models",
        threads=1,
        heartbeat=Heartbeat(enabled=False, notifier=Notifier({})),
    )
    fp32 = pipe.build(BuildRequest("cpu", "fp32"))["accuracy"]
    assert measured == ["tiny-ppl"]  # the reference's perplexity only: the source is not scored again
    m = fp32["metrics"]
    assert m["ppl_increase_pct"] == 0.0 and m["greedy_agreement"] == 1.0 and m["cosine"] == pytest.approx(1.0)
    assert fp32["passed"] and fp32["decode_ms"] == fp32["reference_decode_ms"] > 0
    assert fp32["prefill_ms"] == fp32["reference_prefill_ms"] > 0
    try:
        int8w = pipe.build(BuildRequest("cpu", "int8w"))["accuracy"]
    except GateRefused as exc:  # a random model may miss even a loose budget: the measurement is the subject
        int8w = exc.report["accuracy"]
    assert measured == ["tiny-ppl"] * 2  # the reference's is kept; a real candidate is scored
    assert int8w["metrics"]["perplexity_fp32"] == m["perplexity_fp32"] == m["perplexity"]
    assert int8w["decode_ms"] > 0 and int8w["reference_decode_ms"] > 0
