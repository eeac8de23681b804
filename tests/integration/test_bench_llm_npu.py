"""``edge-agent bench llm`` on an NPU tier under the emulation (OpenVINO's NPU plugin on the CPU, f32).

The tier is a stateful model served one sequence at a time: the agent's scheduler and the bare loop both
run through its stateful session, and openvino-genai's NPU pipeline (when installed) runs the same prompts
on the same stateful IR. Only the report's structure is asserted, never a speed: CPUs differ. Greedy
tokens are checked against an independent reference: the pipeline's must equal the bare loop's over every
logit, and the agent's equal the pipeline's except where the pipeline picks an id the tokenizer does not
define (the agent never does).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.backends import npu
from edge_agent.bench import llm
from edge_agent.bench.options import LLMOptions

pytest.importorskip("openvino")

HAS_OV_GENAI = importlib.util.find_spec("openvino_genai") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One bench run shared by the tests below (its settings isolated as conftest's ``_isolated_env`` does)."""
    tmp_path = tmp_path_factory.mktemp("bench-npu")
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("EDGE_AGENT_")]:
            mp.delenv(key)
        mp.setenv(npu.EMULATION_ENV, "cpu")
        mp.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
        mp.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
        yield _run(tmp_path)


def _run(tmp_path: Path) -> dict:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[models]\ncache_dir = "{tmp_path / "models"}"\n\n'
        f'[engines]\ncache_dir = "{tmp_path / "engines"}"\n\n'
        '[[models.llm]]\nname = "cpu"\nmodel = "demo-phi3"\nbackend = "onnxruntime"\ndevice = "cpu"\n\n'
        '[[models.llm]]\nname = "npu"\nmodel = "demo-phi3"\nbackend = "openvino"\ndevice = "NPU"\n'
    )
    out = tmp_path / "report.json"
    opts = LLMOptions(
        config=config,
        tier="npu",
        rounds=1,
        requests=2,
        prompt_tokens=24,
        max_new_tokens=12,
        genai="none",
        json_out=out,
        quiet=True,
    )
    assert llm.run(opts) == 0
    return json.loads(out.read_text())


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_llm_measures_the_npu_tier_through_its_stateful_session(report: dict) -> None:
    assert report["tier"] == "npu" and report["device"] == "NPU" and report["backend"] == "openvino"
    # the scheduler holds one sequence on a stateful model: the header and limits say so
    assert report["limits"]["max_batch"] == 1 and report["limits"]["preferred_batch_sizes"] == [1]
    assert "stateful session" in report["baseline"]["mode"]
    for side in (report["agent"], report["baseline"]):
        assert side["requests"] == 2 and side["tokens_out"] == 24
        assert _positive(side["ttft_ms"]["p50"]) and _positive(side["decode_tokens_per_s"])
    assert _positive(report["overhead_ratio"]) and _positive(report["decode_ratio"])


@pytest.mark.skipif(HAS_OV_GENAI, reason="openvino-genai is installed: its side runs (next test)")
def test_the_openvino_genai_side_is_skipped_with_its_reason_when_not_installed(report: dict) -> None:
    assert report["ov_genai"] is None
    assert "openvino_genai is not installed" in report["ov_genai_reason"]


@pytest.mark.skipif(not HAS_OV_GENAI, reason="openvino-genai is not installed (pip install 'edge-agent[npu-genai]')")
def test_openvino_genai_npu_pipeline_runs_beside_the_agent_with_the_same_tokens(report: dict) -> None:
    side = report["ov_genai"]
    assert side is not None, report["ov_genai_reason"]
    assert side["requests"] == 2 and side["tokens_out"] == 24
    # the same NPU properties as the agent's, the LLM-mode lengths under the pipeline's names
    assert side["properties"]["NPUW_DEVICES"] == "CPU" and _positive(side["properties"]["MAX_PROMPT_LEN"])
    ratios = side["agent_over_genai"]
    for name in ("ttft_p50", "decode_tokens_per_s"):
        per_round = ratios[name]
        assert len(per_round["rounds"]) == 1 and all(_positive(x) for x in per_round["rounds"])
        assert per_round["min"] <= per_round["median"] <= per_round["max"]
        assert _positive(ratios["pooled"][name])
    tokens = side["tokens"]
    assert tokens["requests"] == 2 and tokens["total"] == 24
    # the pipeline computes what the bare loop over every logit computes, token for token (f32 emulation)
    assert tokens["genai_equal_to_bare_all_logits"] == 2
    # and the agent's tokens are the pipeline's, up to a first pick of an id past the tokenizer's
    assert all(not d["genai_id_known"] for d in tokens["divergences"])
    assert tokens["identical_requests"] + len(tokens["divergences"]) == 2
