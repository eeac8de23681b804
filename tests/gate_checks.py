"""Checking an accuracy-gate decision without assuming one CPU's quantization accuracy.

INT8/FP16 numerics differ between CPUs (AVX2 vs AVX-512 VNNI vs AMX bf16 kernels), so a test asserts
that the gate's verdict follows from the metrics it measured and the recipe's budget, never that an
engine reached some cosine or WER on the machine that wrote the test.
"""

from __future__ import annotations

from typing import Any

from edge_agent.engines.pipeline import BuildRequest, GateRefused, Pipeline
from edge_agent.engines.recipes import AccuracyBudget


def expected_pass(workload: str, metrics: dict[str, float], budget: AccuracyBudget) -> bool:
    if workload == "llm":
        # With a perplexity budget, the logits metrics count only where the recipe sets them.
        gated = budget.model_fields_set if budget.judges_perplexity else {"min_cosine", "min_top1", "max_kl"}
        ppl = budget.max_ppl_increase_pct
        greedy = budget.min_greedy_agreement
        return (
            ("min_cosine" not in gated or metrics["cosine"] >= budget.min_cosine)
            and ("min_top1" not in gated or metrics["top1"] >= budget.min_top1)
            and ("max_kl" not in gated or metrics["kl"] <= budget.max_kl)
            and (ppl is None or 100 * (metrics["perplexity"] / metrics["perplexity_fp32"] - 1) <= ppl)
            and (greedy is None or metrics["greedy_agreement"] >= greedy)
        )
    return metrics["wer_delta"] <= budget.max_wer_delta


def assert_gate_decided(accuracy: dict[str, Any], budget: AccuracyBudget, workload: str = "llm") -> None:
    """The verdict is the budget applied to the measured metrics, with a reason for each refusal."""
    m = accuracy["metrics"]
    assert all(v == v for v in m.values()), f"NaN in the gate's metrics: {m}"
    if workload == "llm":
        assert -1.0 <= m["cosine"] <= 1.0 + 1e-9 and 0.0 <= m["top1"] <= 1.0 and m["kl"] >= -1e-12, m
    passed = expected_pass(workload, m, budget)
    assert accuracy["passed"] == passed, (accuracy, budget)
    assert bool(accuracy["reasons"]) == (not passed), accuracy["reasons"]


def build_gated(pipe: Pipeline, req: BuildRequest) -> dict[str, Any]:
    """The build's report, passed or refused (a refusal is a correct outcome on some CPUs); the
    verdict is checked against the recipe's budget and a refused engine must not be cached."""
    try:
        report = pipe.build(req)
    except GateRefused as exc:
        report = exc.report
        assert pipe.cache.lookup(report["key"]) is None, "a refused engine was cached"
    assert_gate_decided(report["accuracy"], pipe.recipe.accuracy, pipe.recipe.workload)
    return report
