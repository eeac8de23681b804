"""The jetson build path up to the plan, on real artifacts: the tiny demo LLM quantized to Q/DQ by
ONNX Runtime, profiles mapped from the recipe, built by the fake ``tensorrt`` (10.3 and 11.4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import edge_agent.engines.pipeline as pipeline_mod
from edge_agent.engines.pipeline import BuildRequest
from edge_agent.engines.stages import compile_artifact, convert
from tests.fakes import fake_tensorrt
from tests.integration.test_build_onnxruntime import make_pipeline


@pytest.fixture(params=["10.3.0.26", "11.4.0"])
def trt_version(request, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt.as_version(request.param))
    real = pipeline_mod.runtime_version
    monkeypatch.setattr(pipeline_mod, "runtime_version", lambda b: request.param if b == "tensorrt" else real(b))
    return request.param


def stage(tmp_path: Path, precision: str) -> tuple[dict, dict, dict]:
    pipe = make_pipeline(tmp_path)
    req = BuildRequest("jetson", precision)
    parts = pipe.key_parts(req)
    staged = tmp_path / "staged"
    staged.mkdir()
    conversion = convert(pipe.stage_context(), staged, parts, req)
    compiled = compile_artifact(pipe.stage_context(), staged, parts, req)
    return conversion, compiled, json.loads((staged / "model" / "model.plan").read_bytes())


def test_int8_plan_from_the_real_qdq_graph(tmp_path: Path, trt_version: str) -> None:
    conversion, compiled, plan = stage(tmp_path, "int8")
    assert conversion["symmetric"] and conversion["format"] == "QDQ"  # the fake parser refuses zero points != 0
    assert compiled["strongly_typed"] and compiled["builder_flags"] == []
    assert compiled["profiles"] == ["prefill", "decode"] and plan["version"] == trt_version
    prefill, decode = plan["profiles"]
    assert prefill["past_key_values.0.key"][2][2] == 0 and decode["past_key_values.0.key"][2][2] == 127
    assert decode["input_ids"] == [[1, 1], [4, 1], [4, 1]]
    assert Path(compiled["timing_cache"]).is_file() and trt_version in Path(compiled["timing_cache"]).name


def test_fp16_flag_on_10_graph_on_11(tmp_path: Path, trt_version: str) -> None:
    conversion, compiled, plan = stage(tmp_path, "fp16")
    if trt_version.startswith("11"):
        assert conversion["tool"] == "onnxruntime.transformers.float16" and plan["build"]["has_fp16_weights"]
        assert compiled["builder_flags"] == []
    else:
        assert conversion["tool"].startswith("none") and compiled["builder_flags"] == ["FP16"]
