"""An LLM engine built for the NPU (target intel-npu) under the NPU plugin's emulation on the CPU.

The build makes the stateful IR of the NPU's LLM mode from the plain export, with the weight format
asked for, compiles it with the recipe's ``[npu_llm]`` prompt length and KV room into the entry's blob
cache, and gates it against the FP32 export's teacher-forced logits. Served from the cache, the engine
gives the same greedy tokens as ONNX Runtime on the export.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import npu
from edge_agent.config import TierConfig
from edge_agent.engines.pipeline import BuildRequest
from edge_agent.engines.recipes import NpuLlmSpec
from edge_agent.engines.resolve import EngineResolver
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from tests.integration.test_build_onnxruntime import make_pipeline

pytest.importorskip("openvino")
pytest.importorskip("nncf")


@pytest.fixture
def npu_pipeline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    pipe = make_pipeline(tmp_path)
    pipe.recipe = pipe.recipe.model_copy(
        update={
            "targets": ["cpu", "intel-npu"],
            "precisions": ["fp32", "fp16", "int8", "int4"],
            "npu_llm": NpuLlmSpec(max_prompt=64, min_response=64),
        }
    )
    return pipe


def test_an_fp32_npu_engine_is_stateful_gated_exactly_and_served_with_the_exports_tokens(
    npu_pipeline, tmp_path: Path
) -> None:
    report = npu_pipeline.build(BuildRequest("intel-npu", "fp32"))
    conversion, acc = report["conversion"], report["accuracy"]
    assert conversion["kv_states"] == 2 * 2 and conversion["weights"] == "fp32"
    # f32 throughout under the exact emulation: the gate sees the export's own logits
    assert acc["passed"] and acc["metrics"]["cosine"] > 0.9999 and acc["metrics"]["top1"] == 1.0
    assert report["device"].startswith("npu:emulated-cpu:")
    model = Path(report["path"]) / "model"
    assert "beam_idx" in (model / "openvino_model.xml").read_text()
    # the exact emulation compiles anew each time (an imported blob loses its f32 settings); see below
    assert not (model / "openvino").exists() or not list((model / "openvino").glob("*.blob"))

    tier = TierConfig(name="npu", model="demo-phi3", backend="openvino", device="NPU")
    resolver = EngineResolver(npu_pipeline.cache, tmp_path / "models", lambda *_: None)
    resolved = resolver.resolve(tier)
    assert resolved.engine is not None and resolved.engine.key == report["key"]
    on_npu = resolver.open(resolved, tier)
    reference = DecoderLM.open(resolve_model("demo-phi3", tmp_path / "models"), "onnxruntime")
    try:
        assert on_npu.npu_shape == npu.LlmShape(64, 64)
        prompt = [int(t) for t in np.random.default_rng(8).integers(3, 1000, 90)]  # longer than max_prompt
        want = list(reference.generate_greedy(prompt, 20, stop_at_eos=False))
        assert list(on_npu.generate_greedy(prompt, 20, stop_at_eos=False)) == want
    finally:
        on_npu.close()
        reference.close()


def test_int4_weights_under_the_npus_f16_numerics_are_gated_and_their_blob_cached(
    npu_pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edge_agent.engines.pipeline import GateRefused

    monkeypatch.setenv(npu.EMULATION_ENV, "cpu-f16")
    try:
        report = npu_pipeline.build(BuildRequest("intel-npu", "int4"))
    except GateRefused as exc:  # random weights suffer at 4 bits: a refusal with its numbers is right
        report = exc.report
        assert report["accuracy"]["reasons"]
    assert report["conversion"]["compression"].endswith("INT4_SYM")
    assert report["device"].startswith("npu:emulated-cpu-f16:")
    assert 0.0 < report["accuracy"]["metrics"]["cosine"] <= 1.0
    # the gate judged the drift against the recipe's budget, whichever way it went
    assert report["accuracy"]["passed"] == (not report["accuracy"]["reasons"])
    assert report["compile"]["blobs"] == 1


def test_static_int8_is_refused_for_the_npus_llm_mode_with_what_to_build(npu_pipeline) -> None:
    from edge_agent.errors import InputError

    with pytest.raises(InputError, match="weight-only formats"):
        npu_pipeline.build(BuildRequest("intel-npu", "int8"))
