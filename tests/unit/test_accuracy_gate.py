"""Accuracy gate metrics, verdicts and the engine choice, as table tests."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.engines.gate import Verdict, asr_metrics, choose, judge, llm_metrics, render_table
from edge_agent.engines.recipes import AccuracyBudget


def test_identical_logits_are_perfect() -> None:
    x = np.random.default_rng(0).normal(size=(5, 50)).astype(np.float32)
    m = llm_metrics([x], [x.copy()])
    assert m["cosine"] == pytest.approx(1.0) and m["top1"] == 1.0 and m["kl"] == pytest.approx(0.0, abs=1e-12)
    assert m["steps"] == 5


def test_metrics_see_a_flipped_argmax_and_a_known_kl() -> None:
    ref = np.array([[2.0, 0.0], [0.0, 2.0]])
    cand = np.array([[2.0, 0.0], [2.0, 0.0]])  # second step's argmax flips
    m = llm_metrics([ref], [cand])
    assert m["top1"] == 0.5
    p = np.exp([0.0, 2.0]) / np.exp([0.0, 2.0]).sum()
    q = p[::-1]
    assert m["kl"] == pytest.approx((p * np.log(p / q)).sum() / 2)
    assert m["cosine"] == pytest.approx(0.5)  # 1 and 0 (orthogonal)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        llm_metrics([np.zeros((2, 3))], [np.zeros((2, 4))])


def test_asr_metrics_score_both_against_the_references() -> None:
    m = asr_metrics(["turn on the light", "stop"], ["turn on the light", "stop"], ["turn on a light", "stop"])
    assert m["wer_fp32"] == 0.0 and m["wer"] == pytest.approx(0.2) and m["wer_delta"] == pytest.approx(0.2)
    assert m["text_agreement"] == 0.5


@pytest.mark.parametrize(
    "metrics, passed, reason",
    [
        ({"cosine": 0.999, "top1": 0.95, "kl": 0.01}, True, None),
        ({"cosine": 0.98, "top1": 0.95, "kl": 0.01}, False, "cosine 0.9800 < 0.99"),
        ({"cosine": 0.999, "top1": 0.80, "kl": 0.01}, False, "top-1 agreement 0.800 < 0.9"),
        ({"cosine": 0.999, "top1": 0.95, "kl": 0.2}, False, "KL per step 0.2000 > 0.05"),
    ],
)
def test_llm_verdicts(metrics: dict, passed: bool, reason: str | None) -> None:
    v = judge("llm", metrics, AccuracyBudget(), "int8", "onnxruntime")
    assert v.passed is passed
    assert (reason is None and not v.reasons) or any(reason in r for r in v.reasons)


def test_asr_verdict_uses_the_wer_budget() -> None:
    m = {"wer_fp32": 0.10, "wer": 0.13, "wer_delta": 0.03, "text_agreement": 0.9}
    assert not judge("asr", m, AccuracyBudget(max_wer_delta=0.02), "int8", "onnxruntime").passed
    assert judge("asr", m, AccuracyBudget(max_wer_delta=0.05), "int8", "onnxruntime").passed


def v(precision: str, ms: float | None, passed: bool = True) -> Verdict:
    return Verdict(precision, "onnxruntime", {}, {}, passed, [], ms, 10.0)


@pytest.mark.parametrize(
    "candidates, expected",
    [
        ([v("fp32", 10), v("int8", 5)], "int8"),  # faster and passing: INT8
        ([v("fp32", 10), v("int8", 12)], "fp32"),  # INT8 slower than FP32: not chosen
        ([v("fp32", 10), v("fp16", 6), v("int8", 8)], "fp16"),  # INT8 must beat FP16 too
        ([v("fp32", 10), v("int8", 5, passed=False)], "fp32"),  # refused candidates never win
        ([v("fp32", 10), v("int8", 6), v("int4", 4)], "int4"),
        ([v("int8", 6)], "int8"),
        ([v("int8", 6, passed=False)], None),
        ([v("fp32", None)], None),  # unmeasured
    ],
)
def test_choose(candidates: list[Verdict], expected: str | None) -> None:
    chosen = choose(candidates)
    assert (chosen.precision if chosen else None) == expected


def test_table_marks_the_choice_and_the_refusal_reason() -> None:
    good = Verdict("fp32", "onnxruntime", {"cosine": 1.0, "top1": 1.0, "kl": 0.0}, {}, True, [], 10.0, 10.0)
    bad = Verdict("int8", "onnxruntime", {"cosine": 0.9, "top1": 0.5, "kl": 0.3}, {}, False, ["top-1 low"], 5.0, 10.0)
    text = render_table([good, bad], "llm", good)
    assert "PASS ← chosen" in text and "REFUSED: top-1 low" in text and "2.00x" in text


def test_choose_compares_paired_ratios_not_raw_times_measured_under_different_load() -> None:
    fp32 = Verdict("fp32", "onnxruntime", {}, {}, True, [], 18.0, 18.0)  # measured while the device was busy
    fp16 = Verdict("fp16", "onnxruntime", {}, {}, True, [], 14.5, 14.3)  # measured later, device quieter
    int8 = Verdict("int8", "onnxruntime", {}, {}, True, [], 16.0, 20.0)  # 1.25x faster than its own FP32 run
    assert choose([fp32, fp16]) is fp32  # 1.00 vs 1.01 of FP32: no real gain
    assert choose([fp32, fp16, int8]) is int8
