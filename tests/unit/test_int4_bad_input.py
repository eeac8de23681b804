"""The INT4 rung's bad input, each one line naming the key: an unknown method, a block size MatMulNBits refuses,
a sensitivity pass without calibration text, a calibration text with no tokens left; and a budget no candidate
meets, which refuses the build and still reports every candidate it measured (the gate's own reasons)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.engines import gate
from edge_agent.engines import int4_sensitivity as sv
from edge_agent.engines.quantize_weight_only import quantize_matmul_nbits
from edge_agent.engines.recipes import AccuracyBudget, load_recipe
from edge_agent.engines.report import decide, render
from edge_agent.errors import ConfigError, InputError
from edge_agent.models.catalog import inspect_folder

ROOT = Path(__file__).resolve().parents[2]
RECIPE = """
name = "tiny"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int8w", "int4"]
[weight_only]
{extra}
"""


def _refusal(tmp_path: Path, extra: str) -> str:
    (tmp_path / "text.txt").write_text("some calibration words " * 40)
    path = tmp_path / "r.toml"
    path.write_text(RECIPE.format(extra=extra))
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ('algorithm = "awq"', ["weight_only.algorithm", "'awq'"]),
        ("block_size = 24", ["weight_only.block_size", "power of two"]),
        ("block_size = 8", ["weight_only.block_size"]),
        ("head_block_size = 48", ["weight_only.head_block_size"]),
        ("mixed_budget_pct = 5.0", ["mixed_budget_pct", "calibration"]),
        ('algorithm = "gptq"', ["'gptq'", "weight_only.calibration"]),
        ('calibration = "text.txt"\nmixed_budget_pct = -1.0', ["weight_only.mixed_budget_pct"]),
        ('calibration = "text.txt"\nsensitivity_tokens = 1', ["weight_only.sensitivity_tokens"]),
    ],
)
def test_a_recipe_with_bad_int4_keys_is_refused_in_one_line_naming_the_key(
    tmp_path: Path, extra: str, names: list[str]
) -> None:
    text = _refusal(tmp_path, extra)
    assert "\n" not in text
    for name in names:
        assert name in text, text


def _graph(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "model.layers.0.w"], ["y"], name="model.layers.0.mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])],
        [numpy_helper.from_array(w, "model.layers.0.w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"algorithm": "awq"}, "weight_only.algorithm 'awq'"),
        ({"algorithm": "hqq", "block_size": 24}, "weight_only.block_size 24"),
        ({"algorithm": "rtn", "block_size": 24}, "weight_only.block_size 24"),
        ({"algorithm": "hqq", "mixed_budget_pct": 5.0}, "weight_only.mixed_budget_pct"),
        ({"algorithm": "kquant", "head_bits": 8, "head_block_size": 100}, "weight_only.head_block_size 100"),
    ],
)
def test_the_quantizer_refuses_the_same_in_one_line(tmp_path: Path, kwargs: dict, key: str) -> None:
    _graph(tmp_path / "m.onnx")
    with pytest.raises(InputError) as info:
        quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "q.onnx", 4, **kwargs)
    assert key in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "q.onnx").exists()


def test_a_calibration_text_with_no_tokens_left_names_calibration_skip_tokens(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("only a few words here")
    ref = inspect_folder(ROOT / "tests/data/phi3-optimum-tiny")
    with pytest.raises(InputError) as info:
        sv.calibration_ids(ref, text, 4096, 2048)
    assert "calibration_skip_tokens = 4096" in str(info.value) and "\n" not in str(info.value)


BUDGET = AccuracyBudget(max_ppl_increase_pct=1.0, min_greedy_agreement=0.90)
LOWER = {"lower": AccuracyBudget(max_ppl_increase_pct=2.0, min_greedy_agreement=0.95)}


def _candidate(precision: str, method: str, pct: float, greedy: float, ms: float) -> dict:
    metrics = {
        "cosine": 0.99,
        "top1": 0.9,
        "kl": 0.05,
        "perplexity": 20.0 * (1 + pct / 100),
        "perplexity_fp32": 20.0,
        "ppl_increase_pct": pct,
        "greedy_agreement": greedy,
    }
    v = gate.judge("llm", metrics, BUDGET, precision, "onnxruntime", rungs=LOWER)
    v.latency_ms, v.reference_latency_ms = ms, 50.0
    acc = {**v.to_dict(), "timing": "decode", "decode_tok_s": 1e3 / ms, "reference_decode_tok_s": 20.0}
    conversion = {"algorithm": method} if method else {}
    return {"backend": "onnxruntime", "precision": precision, "flavour": "", "accuracy": acc, "conversion": conversion}


def test_a_budget_no_candidate_meets_refuses_and_reports_every_candidate_it_measured() -> None:
    measured = [  # (precision, method, Δppl %, greedy agreement, decode ms): none within either rung
        ("int8w", "", 1.4, 0.93, 20.0),
        ("int4", "gptq", 3.8, 0.85, 16.0),
        ("int4", "hqq", 9.5, 0.78, 16.5),
        ("int4", "kquant", 6.1, 0.81, 16.2),
    ]
    reports = [_candidate(*m) for m in measured]
    assert not any(r["accuracy"]["passed"] for r in reports)  # the gate refuses each one
    out = decide(reports, "llm", "cpu")
    assert out["chosen"] is None and out["rungs"] == {"top": None, "lower": None}
    assert out["verdict"].startswith("chosen: none: every candidate was refused by the accuracy gate")
    rows = {r["candidate"]: r for r in out["rows"]}
    names = ["onnxruntime/int8w", "onnxruntime/int4 gptq", "onnxruntime/int4 hqq", "onnxruntime/int4 kquant"]
    assert list(rows) == ["onnxruntime/fp32 source", *names]  # every candidate, told apart by its method
    for name, (_, _, pct, greedy, ms) in zip(names, measured):
        row = rows[name]
        assert not row["passed"] and not row["chosen"] and row["rungs"] == {"top": False, "lower": False}
        assert row["metrics"]["ppl_increase_pct"] == pct and row["metrics"]["greedy_agreement"] == greedy
        assert row["speedup"] == pytest.approx(50.0 / ms)
        assert any(r.startswith("top: perplexity") for r in row["reasons"])
        assert any(r.startswith("lower: ") for r in row["reasons"])
        assert name in out["verdict"]  # the verdict line gives each one's first reason
    text = render(out, "llm")
    assert "rung top: none within its budget" in text and "rung lower: none within its budget" in text
    for name, (_, _, pct, _, _) in zip(names, measured):
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert f"{pct:+.2f}%" in line and "[within: no rung]" in line


class _Evaluator:
    """Perplexity 10 x (1 + the overridden groups' cost / 100); an 8-bit override costs a tenth of its 4 bits."""

    def __init__(self, cost: dict[str, float]) -> None:
        self.cost = cost

    def perplexity(self, overrides: dict[str, np.ndarray]) -> float:
        extra = sum(self.cost[n] * (0.1 if float(v.flat[0]) == 8.0 else 1.0) for n, v in overrides.items())
        return 10.0 * (1 + extra / 100)


def test_a_mixed_budget_no_prefix_meets_keeps_everything_at_8_bits_and_reports_what_it_measured() -> None:
    cost = {"a": 4.0, "b": 2.0}
    sites = [sv.Site(f"n.{g}", g, "x", (64, 64), g) for g in cost]
    choice = sv.keep_8bit(
        _Evaluator(cost),  # type: ignore[arg-type]  # a stand-in evaluator
        sites,
        lambda s: np.full(1, 4.0),
        0.1,
        lambda s: np.full(1, 8.0),
    )
    report = choice.to_dict()
    # all 4-bit: +6 %; all 8-bit: +0.6 %; both over +0.1 %: said so, with both measurements
    assert report["fits"] is False and report["keep_8bit"] == ["a", "b"]
    assert report["prefixes_measured_pct"] == {"0": pytest.approx(6.0), "2": pytest.approx(0.6)}
    assert report["sensitivity_pct"] == {"a": pytest.approx(4.0), "b": pytest.approx(2.0)}
