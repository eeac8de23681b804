"""The deciding report: verdict line, per-row reasons against the gate's own thresholds, blank times, plot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from edge_agent.engines import gate
from edge_agent.engines.recipes import AccuracyBudget
from edge_agent.engines.report import decide, render

BUDGET = AccuracyBudget(min_cosine=0.995, min_top1=0.95, max_kl=0.02)
CALIB_S = 7.77  # a distinctive conversion time: it must show only on the calibrated INT8 row


def report_of(precision: str, flavour: str, metrics: dict, latency: float, reference: float) -> dict:
    v = gate.judge("llm", metrics, BUDGET, precision, "onnxruntime", flavour)
    v.latency_ms, v.reference_latency_ms = latency, reference
    passed = v.passed
    return {
        "backend": "onnxruntime",
        "precision": precision,
        "flavour": flavour,
        "accuracy": v.to_dict(),
        "conversion": {"seconds": CALIB_S},
        "build_s": 12.5,
        "load_ms": 30.0,
        "cache": "built" if passed else None,
        "key": f"{precision}{flavour}" * 8,
    }


GOOD = {"cosine": 0.9990, "top1": 0.99, "kl": 0.001}
BAD = {"cosine": 0.7131, "top1": 0.251, "kl": 1.5556}


def reports() -> list[dict]:
    return [
        report_of("fp32", "", {"cosine": 1.0, "top1": 1.0, "kl": 0.0}, 13.86, 13.70),
        report_of("fp16", "", GOOD, 14.20, 13.80),
        report_of("int8", "qdq", GOOD, 14.80, 13.76),  # within budget, 0.93x: not worth it
        report_of("int8", "dynamic", BAD, 9.0, 13.9),
    ]  # faster but refused


def test_verdict_line_names_the_gate_choice_and_why_the_others_lost() -> None:
    rs = reports()
    out = decide(rs, "llm", "cpu", [{"candidate": "onnxruntime/int4", "why": "INT4 is OpenVINO only"}])
    # The independent reference: the gate's own rule over the same verdicts, plus the FP32 source at 1.0x.
    verdicts = [
        gate.Verdict(
            **{
                k: r["accuracy"][k]
                for k in (
                    "precision",
                    "backend",
                    "metrics",
                    "budget",
                    "passed",
                    "reasons",
                    "latency_ms",
                    "reference_latency_ms",
                    "flavour",
                )
            }
        )
        for r in rs
    ]
    source = gate.Verdict("fp32", "onnxruntime", {}, {}, True, [], 13.76, 13.76, "source")
    expected = gate.choose([source, *verdicts])
    assert expected is not None
    name = f"{expected.backend}/{expected.precision}" + (f" {expected.flavour}" if expected.flavour else "")
    assert out["verdict"].startswith(f"chosen: {name} ")
    assert [r["candidate"] for r in out["rows"] if r["chosen"]] == [name]
    int8 = next(r for r in out["rows"] if r["flavour"] == "qdq")
    assert f"{13.76 / 14.80:.2f}x" in out["verdict"] and "INT8 qdq within budget" in out["verdict"]
    for r in out["rows"]:
        assert r["chosen"] or r["why_not_chosen"], r  # every row not chosen says why
        if r["latency_ms"] is not None:  # speed is exactly the ratio to the FP32 timing shown beside it
            assert r["speedup"] == pytest.approx(r["reference_latency_ms"] / r["latency_ms"])
    assert int8["passed"] and "within budget" in int8["why_not_chosen"]
    text = render(out, "llm")
    assert text.splitlines()[0] == out["verdict"]
    assert "13.76" in text and "14.80" in text and f"{13.76 / 14.80:.2f}x" in text
    assert "onnxruntime/int4" in text and "INT4 is OpenVINO only" in text
    assert out["skipped"] == [{"candidate": "onnxruntime/int4", "why": "INT4 is OpenVINO only"}]


def test_refused_row_reasons_are_the_gate_thresholds_and_checks_compare_with_the_budget() -> None:
    out = decide(reports(), "llm", "cpu")
    refused = next(r for r in out["rows"] if r["flavour"] == "dynamic")
    assert not refused["passed"]
    assert refused["budget"] == {"min_cosine": BUDGET.min_cosine, "min_top1": BUDGET.min_top1, "max_kl": BUDGET.max_kl}
    assert f"< {BUDGET.min_cosine}" in refused["why_not_chosen"] and f"> {BUDGET.max_kl}" in refused["why_not_chosen"]
    assert refused["checks"]["cosine"] == f"0.7131 < {BUDGET.min_cosine}"
    assert refused["checks"]["KL"] == f"1.5556 > {BUDGET.max_kl}"
    good = next(r for r in out["rows"] if r["precision"] == "fp16")
    assert good["checks"]["cosine"] == f"0.9990 ≥ {BUDGET.min_cosine}"
    assert good["checks"]["top-1"] == f"0.990 ≥ {BUDGET.min_top1}"


def test_times_that_do_not_apply_are_blank() -> None:
    out = decide(reports(), "llm", "cpu")
    rows = {r["candidate"]: r for r in out["rows"]}
    assert rows["onnxruntime/int8 qdq"]["calibration_s"] == CALIB_S
    for name in ("onnxruntime/fp32", "onnxruntime/fp16", "onnxruntime/int8 dynamic", "onnxruntime/fp32 source"):
        assert rows[name]["calibration_s"] is None, name  # no calibration ran for these
    assert rows["onnxruntime/fp32 source"]["build_s"] is None
    hit = {**reports()[2], "cache": "hit"}  # a cache hit built and calibrated nothing now
    [_, hit_row] = decide([hit], "llm", "cpu")["rows"]
    assert hit_row["build_s"] is None and hit_row["calibration_s"] is None and hit_row["load_ms"] == 30.0
    lines = {line.split("  ")[0].strip(): line for line in render(out, "llm").splitlines()}
    assert f"{CALIB_S:.1f}" in lines["onnxruntime/int8 qdq"]
    for name in ("onnxruntime/fp32", "onnxruntime/fp16"):
        assert f"{CALIB_S:.1f}" not in lines[name]


def test_asr_rows_show_delta_wer_against_its_budget_and_the_agree_legend() -> None:
    metrics = gate.asr_metrics(["a b c d"] * 4, ["a b c d"] * 4, ["a b c x", "a b c d", "a b c d", "a b c d"])
    v = gate.judge("asr", metrics, AccuracyBudget(max_wer_delta=0.02), "int8", "onnxruntime", "qdq")
    v.latency_ms, v.reference_latency_ms = 10.0, 11.0
    out = decide(
        [{"backend": "onnxruntime", "precision": "int8", "flavour": "qdq", "accuracy": v.to_dict()}], "asr", "cpu"
    )
    row = next(r for r in out["rows"] if r["flavour"] == "qdq")
    assert row["checks"]["ΔWER"] == f"{metrics['wer_delta']:+.3f} / 0.02"
    assert not row["passed"]  # one word in 16 wrong: ΔWER 0.0625 > 0.02
    text = render(out, "asr")
    assert "agree: share of utterances whose text is identical to FP32's" in text
    assert out["verdict"].startswith("chosen: none: every candidate was refused")  # the source is no engine


def test_every_candidate_refused_says_so_with_the_numbers() -> None:
    for with_source in (True, False):
        out = decide([report_of("int8", "qdq", BAD, 9.0, 13.9)], "llm", "cpu", with_source=with_source)
        assert out["verdict"].startswith("chosen: none: every candidate was refused"), out["verdict"]
        assert f"< {BUDGET.min_cosine}" in out["verdict"]
        assert out["chosen"] is None and not any(r["chosen"] for r in out["rows"])
        assert all(r["why_not_chosen"] for r in out["rows"])


def test_the_source_chosen_over_a_slower_quantized_engine_is_named_the_model_folder() -> None:
    out = decide([report_of("int8", "qdq", GOOD, 14.80, 13.76)], "llm", "cpu")
    assert out["verdict"].startswith("chosen: onnxruntime/fp32 source (the model folder; no engine is faster here)")
    assert "INT8 qdq within budget but 0.93x as fast here" in out["verdict"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the plot extra) not installed")
def test_plot_writes_a_png(tmp_path: Path) -> None:
    from edge_agent.cli.engine_plot import plot_decision

    out = decide(reports(), "llm", "cpu")
    path = plot_decision({**out, "recipe": "r", "target": "cpu"}, "llm", tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
