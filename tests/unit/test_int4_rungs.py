"""Recipe rungs with their own budgets, the gate's verdict per rung and the choice per rung; the 4-bit
method keys and their bad input (one line naming the key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engines import gate
from edge_agent.engines.recipes import AccuracyBudget, load_recipe
from edge_agent.engines.report import decide, render
from edge_agent.errors import ConfigError

BASE = """
name = "tiny"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int8w", "int4"]
{extra}
"""
PPL = """
[perplexity]
data = "text.txt"
[accuracy]
max_ppl_increase_pct = 1.0
min_greedy_agreement = 0.90
"""
LOWER = """
[rungs.lower]
max_ppl_increase_pct = 8.0
min_greedy_agreement = 0.80
"""


def load(tmp_path: Path, extra: str):
    (tmp_path / "text.txt").write_text("calibration words " * 50)
    path = tmp_path / "r.toml"
    path.write_text(BASE.format(extra=extra))
    return load_recipe(path)


def refused(tmp_path: Path, extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, extra)
    return str(info.value)


def test_method_keys_and_their_bad_input_name_the_key(tmp_path: Path) -> None:
    cal = '[weight_only]\nalgorithm = "gptq"\ncalibration = "text.txt"\nmixed_budget_pct = 5.0'
    spec = load(tmp_path, cal).weight_spec
    assert spec.algorithm == "gptq" and spec.mixed_budget_pct == 5.0
    assert spec.calibration == (tmp_path / "text.txt").resolve()  # found like the recipe's other data
    assert spec.key()["calibration"]["sha256"]  # the text by its content in the cache key
    # builds whose sensitivity pass scored the fitted tokens are other engines: the held-apart slice moves the key
    assert spec.key()["sensitivity_slice"] == "after calibration_tokens"
    plain = load(tmp_path, '[weight_only]\nalgorithm = "gptq"\ncalibration = "text.txt"').weight_spec
    assert "sensitivity_slice" not in plain.key()
    hqq = '[weight_only]\nalgorithm = "hqq"\ncalibration = "text.txt"\nmixed_budget_pct = 5.0'
    assert load(tmp_path, hqq).weight_spec.algorithm == "hqq"  # numpy HQQ takes the sensitivity pass too
    assert "weight_only.algorithm" in refused(tmp_path, '[weight_only]\nalgorithm = "awq"')
    assert "calibration" in refused(tmp_path, '[weight_only]\nalgorithm = "gptq"')
    assert "calibration" in refused(tmp_path, "[weight_only]\nmixed_budget_pct = 5.0")
    assert "block_size" in refused(tmp_path, "[weight_only]\nblock_size = 24")


def test_older_recipes_keep_their_keys(tmp_path: Path) -> None:
    plain = load(tmp_path, "[weight_only]\nblock_size = 32")
    assert set(plain.fingerprint()["weight_only"]) == {
        "block_size",
        "symmetric",
        "algorithm",
        "accuracy_level",
        "embedding_bits",
    }
    assert "rungs" not in plain.fingerprint()
    assert "calibration" not in plain.weight_spec.key()


def test_rungs_need_perplexity_text_and_the_top_name_is_accuracy(tmp_path: Path) -> None:
    assert load(tmp_path, PPL + LOWER).rung_budgets()["lower"].max_ppl_increase_pct == 8.0
    assert "rungs.lower" in refused(tmp_path, LOWER)
    assert "rungs.top" in refused(tmp_path, PPL + "[rungs.top]\nmax_ppl_increase_pct = 2.0")


def _metrics(pct: float, greedy: float) -> dict[str, float]:
    return {
        "cosine": 0.99,
        "top1": 0.9,
        "kl": 0.01,
        "perplexity": 10 * (1 + pct / 100),
        "perplexity_fp32": 10.0,
        "ppl_increase_pct": pct,
        "greedy_agreement": greedy,
    }


BUDGET = AccuracyBudget(max_ppl_increase_pct=1.0, min_greedy_agreement=0.9)
RUNGS = {"lower": AccuracyBudget(max_ppl_increase_pct=8.0, min_greedy_agreement=0.8)}


def _verdict(precision: str, pct: float, greedy: float, ms: float) -> gate.Verdict:
    v = gate.judge("llm", _metrics(pct, greedy), BUDGET, precision, "onnxruntime", rungs=RUNGS)
    v.latency_ms, v.reference_latency_ms = ms, 10.0
    return v


def test_the_gate_judges_every_rung_and_each_rung_chooses_within_its_own_budget() -> None:
    int8w, int4, bad = (
        _verdict("int8w", 0.5, 0.97, 6.0),
        _verdict("int4", 6.5, 0.85, 3.0),
        _verdict("int4", 9.0, 0.9, 2.0),
    )
    assert int8w.rungs == {"top": True, "lower": True}
    assert int4.passed and int4.rungs == {"top": False, "lower": True}  # it enters the cache for the lower rung
    assert any(r.startswith("top: perplexity") for r in int4.reasons)
    assert not bad.passed and bad.rungs == {"top": False, "lower": False}
    assert gate.choose([int8w, int4, bad]) is int8w
    assert gate.choose([int8w, int4, bad], "lower") is int4
    assert gate.choose([bad], "lower") is None
    old = gate.judge("llm", _metrics(0.5, 0.97), BUDGET, "int8w", "onnxruntime")  # no rungs: top only
    old.latency_ms = 5.0
    assert old.rungs == {} and gate.choose([old]) is old and gate.choose([old], "lower") is None


def test_a_lower_rung_takes_only_engines_lighter_than_the_top_rungs_choice() -> None:
    # speeds measured in different builds on a shared machine ranked the int8w engine (the top's choice)
    # fastest: the lower rung must still be lighter, or it relieves nothing
    int8w, int4 = _verdict("int8w", 0.5, 0.97, 3.0), _verdict("int4", 3.0, 0.85, 3.5)
    int8w.weight_bytes, int4.weight_bytes = 302e6, 196e6
    assert gate.choose([int8w, int4]) is int8w
    assert gate.choose([int8w, int4], "lower") is int4  # slower as measured, yet the lighter one
    heavier = _verdict("int4", 3.0, 0.85, 2.0)
    heavier.weight_bytes = 310e6  # an engine no lighter than the top's is no lower rung
    assert gate.choose([int8w, heavier], "lower") is None
    unmeasured = _verdict("int4", 3.0, 0.85, 2.0)  # no bytes on record (an older engine): as before
    plain_top = _verdict("int8w", 0.5, 0.97, 3.0)
    assert gate.choose([plain_top, unmeasured], "lower") is unmeasured


def test_the_report_names_each_rungs_engine() -> None:
    def rep(v: gate.Verdict) -> dict:
        acc = {**v.to_dict(), "timing": "decode", "decode_tok_s": 1e3 / (v.latency_ms or 1)}
        acc["reference_decode_tok_s"] = 100.0
        return {"backend": "onnxruntime", "precision": v.precision, "flavour": "", "accuracy": acc, "cache": "built"}

    out = decide([rep(_verdict("int8w", 0.5, 0.97, 6.0)), rep(_verdict("int4", 6.5, 0.85, 3.0))], "llm", "cpu")
    assert out["rungs"] == {"top": "onnxruntime/int8w", "lower": "onnxruntime/int4"}
    assert out["chosen"]["precision"] == "int8w"
    text = render(out, "llm")
    assert "rung lower: onnxruntime/int4" in text and "lower rung only" in text
    assert "INT4 within the lower rung's budget only" in out["verdict"]
