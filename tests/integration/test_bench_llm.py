"""`bench llm` end to end on the tiny demo-phi3: report structure, internal consistency, plot, bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edge_agent.cli import build_parser
from edge_agent.errors import InputError

REQUESTS, PROMPT, NEW = 4, 16, 8
GENAI_PHI3 = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "llm", *argv])


def _base(tmp_path) -> list[str]:
    return [
        "--model",
        "demo-phi3",
        "--requests",
        str(REQUESTS),
        "--prompt-tokens",
        str(PROMPT),
        "--max-new-tokens",
        str(NEW),
        "--rounds",
        "2",
        "--cache-dir",
        str(tmp_path / "models"),
        "--quiet",
    ]


def _check_stats(side: dict) -> None:
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert side[metric]["count"] == REQUESTS
    assert side["itl_ms"]["count"] == REQUESTS * (NEW - 1)
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = side[metric]
        assert 0 < s["p50"] <= s["p95"] <= s["p99"]
        assert s["mean"] > 0
    assert side["requests"] == REQUESTS and side["tokens_out"] == REQUESTS * NEW
    assert side["tokens_per_s"] > 0 and side["requests_per_s"] > 0
    assert 0 <= side["goodput"] <= side["requests_per_s"] + 1e-9
    assert side["tokens_per_s"] == pytest.approx(side["requests_per_s"] * NEW, rel=0.35)  # medians of each


@pytest.mark.slow
@pytest.mark.parametrize("concurrency,rate", [(1, None), (2, None), (1, 50.0), (2, 50.0)])
def test_bench_llm_report(tmp_path, capsys, concurrency, rate):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [*_base(tmp_path), "--concurrency", str(concurrency), "--json", str(out), "--plot", str(png)]
    if rate is not None:
        argv += ["--rate", str(rate)]
    args = _parse(argv)
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["rounds"]["count"] == 2
    assert report["arrivals"] == ("closed-loop" if rate is None else "poisson")
    _check_stats(report["agent"])
    _check_stats(report["baseline"])
    assert len(report["agent"]["per_round_tokens_per_s"]) == 2
    if concurrency == 1:
        assert report["overhead_ratio"] > 0 and report["decode_ratio"] > 0
        assert report["agent"]["decode_tokens_per_s"] > 0
    else:
        assert report["overhead_ratio"] is None and report["decode_ratio"] is None
        assert report["agent"]["decode_tokens_per_s"] is None
        assert any("concurrency 1" in n for n in report["notes"])
    roof = report["roofline"]
    assert roof["bandwidth_gb_s"] > 0 and roof["bytes_per_token"] > roof["weight_bytes"] > 0
    assert roof["bound_tokens_per_s"] == pytest.approx(roof["bandwidth_gb_s"] * 1e9 / roof["bytes_per_token"], rel=0.01)
    assert 0 < roof["fraction"] < 1.5
    assert roof["bandwidth_method"] in ("onnxruntime-matmul", "numpy-sum")
    assert report["genai"] is None and "no onnxruntime-genai folder" in report["genai_reason"]
    assert report["ramp_s"] == 0 if concurrency == 1 or rate else report["ramp_s"] > 0
    assert png.is_file() and png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "ttft_ms p99" in printed and "roofline" in printed


@pytest.mark.slow
def test_bench_llm_compares_with_onnxruntime_genai_on_the_same_weights(tmp_path):
    """The genai side runs og.Generator on demo-phi3's genai folder (same weights, GroupQueryAttention):
    same request counts, its own ratios, and greedy tokens identical to the bare loop's."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (extra 'genai')")
    out = tmp_path / "r.json"
    args = _parse([*_base(tmp_path), "--genai", str(GENAI_PHI3), "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    genai = report["genai"]
    _check_stats(genai)
    assert genai["token_agreement"] == 1.0
    ratios = genai["agent_over_genai"]
    assert ratios["ttft_p50"] == pytest.approx(report["agent"]["ttft_ms"]["p50"] / genai["ttft_ms"]["p50"])
    assert ratios["decode_tokens_per_s"] > 0
    paired = ratios["decode_per_round"]  # one agent/genai ratio per round, each round's sides run back to back
    assert len(paired["rounds"]) == 2 and all(r > 0 for r in paired["rounds"])
    assert min(paired["rounds"]) <= paired["median"] <= max(paired["rounds"])
    roof = report["roofline"]  # both sides against the same bound
    assert roof["genai_fraction"] == pytest.approx(genai["decode_tokens_per_s"] / roof["bound_tokens_per_s"], rel=0.01)


def test_bench_llm_genai_folder_must_be_one(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (extra 'genai')")
    args = _parse([*_base(tmp_path), "--genai", str(tmp_path)])
    with pytest.raises(InputError, match=r"no genai_config\.json"):
        args.func(args)


def test_bench_llm_scaling_runs_both_concurrencies_in_the_same_rounds(tmp_path):
    out = tmp_path / "r.json"
    args = _parse([*_base(tmp_path), "--concurrency", "1", "--scaling", "2", "--no-baseline", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    sc = report["scaling"]
    assert sc["concurrency"] == 2
    _check_stats(sc["agent"])
    assert sc["tokens_per_s_ratio"] == pytest.approx(sc["agent"]["tokens_per_s"] / report["agent"]["tokens_per_s"])
    assert sc["ttft_p99_ratio"] == pytest.approx(sc["agent"]["ttft_ms"]["p99"] / report["agent"]["ttft_ms"]["p99"])


def test_bench_llm_no_baseline(tmp_path):
    out = tmp_path / "r.json"
    args = _parse([*_base(tmp_path), "--no-baseline", "--rounds", "1", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["baseline"] is None and report["overhead_ratio"] is None
    assert report["roofline"]["achieved_source"] == "agent"


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--requests", "0", "--requests"),
        ("--concurrency", "0", "--concurrency"),
        ("--rate", "0", "--rate"),
        ("--rate", "-2", "--rate"),
        ("--prompt-tokens", "0", "--prompt-tokens"),
        ("--prompt-tokens", "100000", "context"),
        ("--max-new-tokens", "0", "--max-new-tokens"),
        ("--scaling", "0", "--scaling"),
    ],
)
def test_bench_llm_bad_numbers(tmp_path, flag, value, message):
    args = _parse([*_base(tmp_path), flag, value])
    with pytest.raises(InputError, match=message):
        args.func(args)


def test_bench_llm_unknown_model(tmp_path):
    from edge_agent.errors import ModelNotFound

    args = _parse([*_base(tmp_path), "--model", "no-such-model"])
    with pytest.raises(ModelNotFound):
        args.func(args)


def test_bench_llm_measures_the_tier_with_the_daemons_batching_from_the_config(tmp_path, capsys):
    """With the fixed wait (adaptive_wait = false) a lone request waits batch_timeout_ms for batch-mates in
    the daemon (max_batch 4, no preferred size 1): bench llm at C=1 must wait the same, with the limits
    tier_limits gives that config."""
    from edge_agent.config import load_settings
    from edge_agent.serving.llm.tiers import tier_limits

    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        '[[models.llm]]\nname = "t"\nmodel = "demo-phi3"\nmax_batch = 4\n\n'
        "[batching]\nmax_batch = 4\nbatch_timeout_ms = 300\npreferred_batch_sizes = [2, 4]\nadaptive_wait = false\n"
    )
    out = tmp_path / "r.json"
    argv = [*_base(tmp_path), "--config", str(cfg), "--no-baseline", "--rounds", "1", "--json", str(out)]
    args = _parse(argv)
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    settings = load_settings(cfg)
    expected = tier_limits(settings.models.llm[0], settings.batching, settings.prefix_cache, settings.sla.target_ms)
    assert report["limits"]["max_batch"] == expected.max_batch == 4
    assert report["limits"]["batch_timeout_ms"] == expected.batch_timeout_ms == 300
    assert report["limits"]["preferred_batch_sizes"] == list(expected.preferred_batch_sizes)
    assert expected.adaptive is False
    assert report["tier"] == "t" and report["config"] == str(cfg)
    assert report["agent"]["ttft_ms"]["count"] == REQUESTS
    assert report["agent"]["ttft_ms"]["p50"] >= 300.0  # every lone request waited the configured timeout
    assert any("batch_timeout_ms (300)" in n for n in report["notes"])
    printed = capsys.readouterr().out
    assert printed.startswith("bench llm: tier 't' as the daemon serves it: model folder ") and str(cfg) in printed
