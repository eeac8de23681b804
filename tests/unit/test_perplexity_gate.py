"""The gate's perplexity budget (Δperplexity over FP32, greedy agreement) and the recipe keys behind it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.engines.gate import judge, perplexity_metrics
from edge_agent.engines.recipes import AccuracyBudget, load_recipe
from edge_agent.engines.report import decide, render
from edge_agent.errors import ConfigError

LOGITS = {"cosine": 0.9, "top1": 0.5, "kl": 0.3, "steps": 10.0}  # beyond every default logits budget


def metrics(pct: float, fp32: float = 20.0, greedy: float = 0.97) -> dict[str, float]:
    """A candidate ``pct`` percent over FP32's perplexity (the gate judges the percentage it is given)."""
    return {
        **LOGITS,
        "perplexity": fp32 * (1 + pct / 100),
        "perplexity_fp32": fp32,
        "ppl_increase_pct": pct,
        "greedy_agreement": greedy,
    }


@pytest.mark.parametrize(
    ("pct", "greedy", "passed", "says"),
    [
        (0.0, 0.97, True, []),
        (1.0, 0.97, True, []),  # at the budget passes
        (1.001, 0.97, False, ["perplexity 20.2002 is +1.00% over FP32's 20.0000 (budget +1.0%)"]),
        (-2.5, 0.97, True, []),  # lower than FP32 is within any budget
        (0.0, 0.90, True, []),  # greedy agreement at the budget passes
        (0.0, 0.8999, False, ["greedy agreement with FP32 0.8999 < 0.9"]),
        (
            25.0,
            0.5,
            False,
            [
                "perplexity 25.0000 is +25.00% over FP32's 20.0000 (budget +1.0%)",
                "greedy agreement with FP32 0.5000 < 0.9",
            ],
        ),
    ],
)
def test_the_perplexity_budget_at_its_boundaries(pct, greedy, passed, says) -> None:
    budget = AccuracyBudget(max_ppl_increase_pct=1.0, min_greedy_agreement=0.9)
    verdict = judge("llm", metrics(pct, greedy=greedy), budget, "int8w", "onnxruntime")
    assert verdict.passed is passed
    assert verdict.reasons == says
    # The logits metrics are reported but not gated: the recipe did not set them.
    assert verdict.budget == {"max_ppl_increase_pct": 1.0, "min_greedy_agreement": 0.9}


def test_logits_budgets_the_recipe_sets_are_gated_beside_perplexity() -> None:
    budget = AccuracyBudget(max_ppl_increase_pct=1.0, min_cosine=0.95)
    verdict = judge("llm", metrics(0.0), budget, "int4", "onnxruntime")
    assert not verdict.passed and verdict.reasons == ["logits cosine 0.9000 < 0.95"]
    assert set(verdict.budget) == {"max_ppl_increase_pct", "min_cosine"}


def test_without_a_perplexity_budget_the_logits_gate_is_unchanged() -> None:
    verdict = judge("llm", metrics(50.0), AccuracyBudget(), "int4", "onnxruntime")
    assert not verdict.passed and len(verdict.reasons) == 3
    assert set(verdict.budget) == {"min_cosine", "min_top1", "max_kl"}


def test_a_perplexity_budget_without_a_measurement_refuses() -> None:
    verdict = judge("llm", dict(LOGITS), AccuracyBudget(max_ppl_increase_pct=1.0), "int4", "onnxruntime")
    assert not verdict.passed and "no perplexity measured" in verdict.reasons[0]


def test_perplexity_metrics_by_hand() -> None:
    ref = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    cand = np.array([1, 2, 3, 0, 5, 6, 0, 8])
    m = perplexity_metrics(10.0, 10.5, ref, cand)
    assert m["ppl_increase_pct"] == pytest.approx(5.0)
    assert m["greedy_agreement"] == 0.75 and m["ppl_tokens"] == 8
    with pytest.raises(ValueError, match="same, non-zero number"):
        perplexity_metrics(10.0, 10.0, ref, cand[:3])


def test_the_report_shows_delta_perplexity_per_candidate() -> None:
    budget = AccuracyBudget(max_ppl_increase_pct=1.0, min_greedy_agreement=0.9)
    reports = []
    for precision, pct, greedy, ms in (("int8w", 0.5, 0.97, 5.0), ("int4", 5.0, 0.88, 4.0)):
        v = judge("llm", metrics(pct, greedy=greedy), budget, precision, "onnxruntime")
        acc = {**v.to_dict(), "latency_ms": ms, "reference_latency_ms": 10.0, "timing": "decode"}
        reports.append({"precision": precision, "flavour": "", "accuracy": acc})
    out = decide(reports, "llm", "cpu")
    rows = {r["candidate"]: r for r in out["rows"]}
    assert rows["onnxruntime/fp32 source"]["checks"]["ppl"] == "20.000 +0.00% ≤ 1.0%"
    assert rows["onnxruntime/int8w"]["checks"]["ppl"] == "20.100 +0.50% ≤ 1.0%"
    assert rows["onnxruntime/int4"]["checks"]["ppl"] == "21.000 +5.00% > 1.0%"
    assert rows["onnxruntime/int4"]["checks"]["greedy"] == "0.880 < 0.9"
    assert rows["onnxruntime/int8w"]["chosen"] and not rows["onnxruntime/int4"]["passed"]
    text = render(out, "llm")
    assert "ppl" in text.splitlines()[2] and "+5.00% > 1.0%" in text and "Δppl" in text


RECIPE = """
name = "t"
model = "demo-gemma"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int8w"]
[heldout]
data = "held.jsonl"
"""


def test_recipe_perplexity_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        RECIPE + '[perplexity]\ndata = "text.txt"\nmax_tokens = 0\nwindow = 64\nstride = 64\n'
        "[accuracy]\nmax_ppl_increase_pct = 2.5\nmin_greedy_agreement = 0.8\n"
    )
    recipe = load_recipe(path)
    assert recipe.perplexity is not None
    assert (recipe.perplexity.max_tokens, recipe.perplexity.window, recipe.perplexity.stride) == (0, 64, 64)
    assert recipe.perplexity.chunk == 256
    assert recipe.resolve(recipe.perplexity.data) == tmp_path / "text.txt"
    assert recipe.accuracy.max_ppl_increase_pct == 2.5 and recipe.accuracy.min_greedy_agreement == 0.8
    assert recipe.fingerprint()["perplexity"]["window"] == 64
    assert recipe.fingerprint()["accuracy"]["max_ppl_increase_pct"] == 2.5


def test_a_recipe_without_perplexity_keeps_its_fingerprint_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(RECIPE)
    fp = load_recipe(path).fingerprint()
    assert "perplexity" not in fp
    assert set(fp["accuracy"]) == {"min_cosine", "min_top1", "max_kl", "max_wer_delta"}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("[accuracy]\nmax_ppl_increase_pct = 1.0\n", "need a [perplexity] section"),
        ('[perplexity]\ndata = "t.txt"\nwindow = 16\nstride = 32\n', "stride 32 > window 16"),
        ('[perplexity]\ndata = "t.txt"\n[accuracy]\nmax_ppl_increase_pct = -1\n', "max_ppl_increase_pct"),
        ('[perplexity]\ndata = "t.txt"\n[accuracy]\nmin_greedy_agreement = 1.5\n', "min_greedy_agreement"),
        ('[perplexity]\ndata = "t.txt"\nwindows = 4\n', "windows: unknown key"),
    ],
)
def test_bad_perplexity_keys_are_refused_by_name(tmp_path: Path, extra: str, says: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(RECIPE + extra)
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(path)


def test_perplexity_is_refused_in_an_asr_recipe(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        RECIPE.replace('"llm"', '"asr"').replace('"fp32", "int8w"', '"fp32"') + '[perplexity]\ndata = "t.txt"\n'
    )
    with pytest.raises(ConfigError, match="scores LLMs"):
        load_recipe(path)


def test_the_shipped_gemma3_recipe_gates_by_perplexity() -> None:
    recipe = load_recipe("gemma-3-270m")
    assert recipe.model == "gemma-3-270m" and recipe.perplexity is not None
    assert recipe.resolve(recipe.perplexity.data).is_file()
    assert recipe.accuracy.max_ppl_increase_pct == 1.0
    assert {"fp32", "fp16", "int8", "int8w", "int4"} <= set(recipe.precisions)
