"""The 4-bit calibration text in two slices: the method fits on ``calibration_tokens`` after the skipped ones,
and the sensitivity pass scores the ``sensitivity_tokens`` right after them, so no token is in both (a tiny
Phi-3 export through quantize_matmul_nbits, with what each step was fed recorded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engines import int4_sensitivity as sv
from edge_agent.engines.quantize_weight_only import quantize_matmul_nbits
from edge_agent.errors import InputError
from edge_agent.models.catalog import inspect_folder
from edge_agent.models.perplexity import text_tokens
from edge_agent.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests/data/phi3-optimum-tiny"
TEXT = ROOT / "calibration/llm/text/python-reference.txt"


def _positions(windows: list[list[int]], ids: list[int], bos: int | None, start: int) -> list[int]:
    """Where the windows' tokens (BOS dropped) sit in the text: they must be ``ids`` from ``start`` on, in order."""
    fed = [t for w in windows for t in (w[1:] if bos is not None and w[0] == bos else w)]
    assert fed == ids[start : start + len(fed)], "the windows are not the text's tokens from there on"
    return list(range(start, start + len(fed)))


def test_the_sensitivity_pass_scores_tokens_the_method_did_not_fit_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = inspect_folder(TINY)
    ids, bos = text_tokens(Tokenizer(ref.path, ref.model_type), TEXT.read_text())
    fitted: list[list[int]] = []
    scored: list[list[int]] = []
    said: list[str] = []
    real_stats, real_evaluator = sv.activation_stats, sv.Evaluator

    def stats(model, windows, *args, **kwargs):
        windows = [list(w) for w in windows]
        fitted.extend(windows)
        return real_stats(model, windows, *args, **kwargs)

    def evaluator(model, windows, *args, **kwargs):
        scored.extend(list(w) for w in windows)
        return real_evaluator(model, windows, *args, **kwargs)

    monkeypatch.setattr(sv, "activation_stats", stats)
    monkeypatch.setattr(sv, "Evaluator", evaluator)
    info = quantize_matmul_nbits(
        TINY / "model.onnx",
        tmp_path / "q.onnx",
        4,
        32,
        algorithm="gptq",
        calibration=TEXT,
        calibration_skip_tokens=100,
        calibration_tokens=700,
        sensitivity_tokens=300,
        mixed_budget_pct=50.0,
        source=ref,
        progress=said.append,
    )
    # the long steps say where they are (a build shows them on its weight-only progress line)
    assert any(m.startswith("gptq 1/") for m in said) and any(m.startswith("sensitivity 1/") for m in said)
    fit = _positions(fitted, ids, bos, 100)
    score = _positions(scored, ids, bos, 800)
    assert len(fit) == 700 and len(score) == 300
    assert not set(fit) & set(score)  # no token both fitted on and scored
    assert info["calibration"]["fit_tokens"] == [100, 800]
    assert info["calibration"]["sensitivity_tokens"] == [800, 1100]
    assert "mixed" in info and info["mixed"]["calibration_ppl_fp32"] > 1


def test_a_text_too_short_for_the_sensitivity_slice_names_the_key(tmp_path: Path) -> None:
    ref = inspect_folder(TINY)
    text = tmp_path / "t.txt"
    text.write_text(TEXT.read_text()[:4000])
    total = sv.calibration_text(ref, text, 0, 100_000).total
    with pytest.raises(InputError) as info:
        sv.calibration_text(ref, text, 10, total - 11, 512)  # one token left after the fitted ones
    assert str(info.value).startswith("weight_only.sensitivity_tokens 512:") and "\n" not in str(info.value)
    cut = sv.calibration_text(ref, text, 10, total - 20, 512)  # what is left, when 2 or more
    assert cut.score_range == (total - 10, total) and cut.fit_range == (10, total - 10)


def test_a_budget_of_zero_keeps_at_8_bits_every_group_whose_4_bits_cost_anything(tmp_path: Path) -> None:
    # 0 % is a budget (the recipe accepts it), not "no budget": the pass runs and scores its slice
    info = quantize_matmul_nbits(
        TINY / "model.onnx",
        tmp_path / "q.onnx",
        4,
        32,
        algorithm="rtn_asym",
        calibration=TEXT,
        calibration_skip_tokens=100,
        calibration_tokens=300,
        sensitivity_tokens=200,
        mixed_budget_pct=0.0,
        source=inspect_folder(TINY),
    )
    assert info["calibration"]["sensitivity_tokens"] == [400, 600]
    assert info["mixed"]["calibration_ppl_fp32"] > 1
