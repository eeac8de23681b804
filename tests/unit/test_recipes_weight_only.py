"""The weight-only recipe keys (int8w, int4, [weight_only]) and the report's decode columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engines import gate
from edge_agent.engines.recipes import AccuracyBudget, load_recipe
from edge_agent.engines.report import decide, render
from edge_agent.engines.stages import weight_only_unsupported
from edge_agent.errors import ConfigError

BASE = """
name = "tiny"
model = "demo-phi3"
workload = "{workload}"
targets = ["cpu"]
precisions = [{precisions}]
{extra}
"""


def load(tmp_path: Path, precisions: str, extra: str = "", workload: str = "llm"):
    path = tmp_path / "r.toml"
    path.write_text(BASE.format(precisions=precisions, extra=extra, workload=workload))
    return load_recipe(path)


def refused(tmp_path: Path, *args: str, **kw: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, *args, **kw)
    return str(info.value)


def test_weight_only_precisions_and_their_settings(tmp_path: Path) -> None:
    recipe = load(tmp_path, '"fp32", "int8w", "int4"', "[weight_only]\nblock_size = 64\nsymmetric = false")
    assert recipe.weight_spec.block_size == 64 and not recipe.weight_spec.symmetric
    assert recipe.weight_spec.accuracy_level == 4 and recipe.weight_spec.algorithm == "rtn"
    assert load(tmp_path, '"int4"').weight_spec.block_size == 32  # defaults when absent


def test_bad_weight_only_recipes_are_refused_naming_the_key(tmp_path: Path) -> None:
    assert "int8w is weight-only" in refused(tmp_path, '"fp32", "int8w"', workload="asr")
    assert "block_size" in refused(tmp_path, '"int4"', "[weight_only]\nblock_size = 48")
    assert "weight_only" in refused(tmp_path, '"fp32"', "[weight_only]\nblock_size = 32")
    assert "algorithm" in refused(tmp_path, '"int4"', '[weight_only]\nalgorithm = "gptq"')
    assert "bits" in refused(tmp_path, '"int4"', "[weight_only]\nbits = 3")  # unknown key


def test_a_recipe_without_weight_only_keeps_its_fingerprint(tmp_path: Path) -> None:
    plain = load(tmp_path, '"fp32", "int4"')
    assert "weight_only" not in plain.fingerprint()  # engine keys of older recipes do not move
    assert load(tmp_path, '"int4"', "[weight_only]").fingerprint()["weight_only"]["block_size"] == 32
    assert "head_bits" not in load(tmp_path, '"int4"', "[weight_only]").fingerprint()["weight_only"]


def test_the_head_settings_are_validated_and_move_the_key_only_when_set(tmp_path: Path) -> None:
    head = load(tmp_path, '"int4"', "[weight_only]\nhead_bits = 8\nhead_block_size = 128")
    assert (head.weight_spec.head_bits, head.weight_spec.head_block_size) == (8, 128)
    assert head.fingerprint()["weight_only"]["head_block_size"] == 128
    assert head.fingerprint() != load(tmp_path, '"int4"', "[weight_only]").fingerprint()
    assert "head_block_size" in refused(tmp_path, '"int4"', "[weight_only]\nhead_block_size = 100")
    assert "head_bits" in refused(tmp_path, '"int4"', "[weight_only]\nhead_bits = 6")


def test_a_per_precision_head_block_size_moves_only_that_precisions_key(tmp_path: Path) -> None:
    base = load(tmp_path, '"int8w", "int4"', "[weight_only]")
    per = load(tmp_path, '"int8w", "int4"', "[weight_only]\nhead_block_size = { int4 = 128 }")
    assert per.fingerprint() == base.fingerprint()  # fp32 and the other precision keep their engines
    assert per.weight_spec.for_precision("int8w").key() == base.weight_spec.key()
    assert per.weight_spec.for_precision("int4").key()["head_block_size"] == 128
    assert per.weight_spec.ort_args("int4")["head_block_size"] == 128
    assert per.weight_spec.ort_args("int8w")["head_block_size"] == 0  # 0: the precision's block_size
    assert "head_block_size" in refused(tmp_path, '"int4"', "[weight_only]\nhead_block_size = { int4 = 96 }")
    assert "head_block_size" in refused(tmp_path, '"int4"', "[weight_only]\nhead_block_size = { fp16 = 64 }")


def test_a_per_precision_block_size_moves_only_that_precisions_key(tmp_path: Path) -> None:
    base = load(tmp_path, '"fp32", "int8w", "int4"', "[weight_only]")
    per = load(tmp_path, '"fp32", "int8w", "int4"', "[weight_only]\nblock_size = { int4 = 128 }")
    assert per.fingerprint() == base.fingerprint()  # fp32's and int8w's engines keep their keys
    assert per.weight_spec.for_precision("int8w").key() == base.weight_spec.key()
    assert per.weight_spec.for_precision("int4").key()["block_size"] == 128
    assert per.weight_spec.ort_args("int4")["block_size"] == 128
    assert per.weight_spec.ort_args("int8w")["block_size"] == 32  # not named: the default
    assert per.weight_spec.for_precision("int4").block == 128
    with pytest.raises(TypeError, match="for_precision"):
        per.weight_spec.block  # noqa: B018 - a size per precision has no one value
    both = load(tmp_path, '"int8w", "int4"', "[weight_only]\nblock_size = { int8w = 64, int4 = 128 }")
    assert both.weight_spec.ort_args("int8w")["block_size"] == 64
    assert "block_size" in refused(tmp_path, '"int4"', "[weight_only]\nblock_size = { int4 = 96 }")
    assert "block_size" in refused(tmp_path, '"int4"', "[weight_only]\nblock_size = { int8 = 64 }")
    assert "block_size" in refused(tmp_path, '"int4"', "[weight_only]\nblock_size = 8")
    assert "block_size" in refused(tmp_path, '"int4"', "[weight_only]\nblock_size = 0")


def test_only_tensorrt_lacks_a_weight_only_path() -> None:
    assert weight_only_unsupported("onnxruntime", "int4") is None
    assert weight_only_unsupported("openvino", "int8w") is None
    assert weight_only_unsupported("tensorrt", "int8") is None
    assert "tensorrt has no weight-only path" in (weight_only_unsupported("tensorrt", "int4") or "")


def _report(precision: str, metrics: dict, decode_ms: float, ref_decode_ms: float, nbytes: int) -> dict:
    v = gate.judge("llm", metrics, AccuracyBudget(), precision, "onnxruntime")
    v.latency_ms, v.reference_latency_ms = decode_ms, ref_decode_ms
    acc = {
        **v.to_dict(),
        "timing": "decode",
        "decode_tok_s": 1e3 / decode_ms,
        "reference_decode_tok_s": 1e3 / ref_decode_ms,
        "prefill_ms": 5.0,
        "reference_prefill_ms": 10.0,
        "weight_bytes": nbytes,
        "reference_weight_bytes": 98_000_000,
    }
    return {"backend": "onnxruntime", "precision": precision, "flavour": "", "accuracy": acc, "cache": "built"}


def test_the_report_shows_decode_rates_prefill_speed_and_bytes_per_token() -> None:
    good, bad = {"cosine": 0.9997, "top1": 0.95, "kl": 0.0001}, {"cosine": 0.96, "top1": 0.57, "kl": 0.008}
    reports = [_report("int8w", good, 4.0, 10.0, 27_600_000), _report("int4", bad, 2.5, 10.0, 15_300_000)]
    out = decide(reports, "llm", "cpu")
    rows = {r["candidate"]: r for r in out["rows"]}
    assert rows["onnxruntime/int8w"]["chosen"] and not rows["onnxruntime/int4"]["passed"]
    assert rows["onnxruntime/int4"]["speedup"] == pytest.approx(10.0 / 2.5)
    assert rows["onnxruntime/int8w"]["decode_tok_s"] == pytest.approx(250.0)
    assert rows["onnxruntime/int8w"]["prefill_speedup"] == pytest.approx(2.0)
    source = rows["onnxruntime/fp32 source"]
    assert source["decode_tok_s"] == pytest.approx(100.0) and source["bytes_per_token"] == 98_000_000
    text = render(out, "llm")
    assert "tok/s" in text and "bytes/tok" in text and "27.6 MB" in text and "15.3 MB" in text
    assert "250.0" in text and "4.00x" in text
