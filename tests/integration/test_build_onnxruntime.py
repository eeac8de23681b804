"""Real builds with ONNX Runtime on the CPU: FP32/FP16/INT8 of the tiny demo LLM, the cache, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import edge_agent.engines.pipeline as pipeline_mod
from edge_agent.engines.cache import EngineCache
from edge_agent.engines.pipeline import BuildRequest, GateRefused, Heartbeat, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.engines.stages import profile_shapes
from edge_agent.errors import BackendUnavailable, ConfigError, InputError
from edge_agent.systemd import Notifier
from tests.gate_checks import build_gated

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
name = "tiny-phi3"
model = "demo-phi3"
workload = "llm"
targets = ["cpu", "jetson"]
precisions = ["fp32", "fp16", "int8"]
[calibration]
data = "{calib}"
samples = 8
max_tokens = 24
[heldout]
data = "{heldout}"
samples = 4
[accuracy]
min_cosine = {min_cosine}
min_top1 = 0.5
max_kl = 0.5
[[profiles]]
name = "prefill"
[profiles.dims]
batch_size = [1, 1, 4]
sequence_length = [1, 16, 64]
past_sequence_length = [0, 0, 0]
total_sequence_length = [1, 16, 64]
[[profiles]]
name = "decode"
[profiles.dims]
batch_size = [1, 4, 4]
sequence_length = [1, 1, 1]
past_sequence_length = [1, 32, 127]
total_sequence_length = [2, 33, 128]
"""


def make_recipe(tmp_path: Path, min_cosine: float = 0.9, calib: Path | None = None) -> Path:
    path = tmp_path / "tiny-phi3.toml"
    path.write_text(
        RECIPE.format(
            calib=calib or ROOT / "calibration/llm/prompts.jsonl",
            heldout=ROOT / "calibration/llm/heldout.jsonl",
            min_cosine=min_cosine,
        )
    )
    return path


def make_pipeline(tmp_path: Path, **kw) -> Pipeline:
    cache = EngineCache(tmp_path / "engines", 1 << 30)
    return Pipeline(
        load_recipe(make_recipe(tmp_path, **kw)),
        cache,
        tmp_path / "models",
        threads=1,
        heartbeat=Heartbeat(enabled=False, notifier=Notifier({})),
    )


def test_int8_qdq_is_symmetric_per_channel_and_gated(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path)
    # INT8 accuracy differs between CPUs (u8s8 on AVX2 vs VNNI): the gate's decision is checked against
    # the recipe's budget, and a refusal (a correct outcome on some CPUs) leaves no engine to inspect.
    report = build_gated(pipe, BuildRequest("cpu", "int8"))
    acc = report["accuracy"]
    assert report["flavour"] == "qdq" and acc["metrics"]["steps"] > 10
    if not acc["passed"]:
        return
    assert report["cache"] == "built"
    assert acc["latency_ms"] > 0 and acc["reference_latency_ms"] > 0
    # The calibrated graph (before ORT fuses it) carries Q/DQ pairs with zero points of 0 only.
    staged_model = onnx.load(str(Path(report["path"]) / "model" / "model.onnx"))
    quantized = ("QuantizeLinear", "MatMulInteger", "DynamicQuantizeLinear")
    assert any(
        n.op_type.startswith("QLinear") or n.op_type in quantized or n.domain == "com.microsoft"
        for n in staged_model.graph.node
    )
    zero_points = [onnx.numpy_helper.to_array(i) for i in staged_model.graph.initializer if "zero_point" in i.name]
    assert zero_points and all(np.all(z == 0) for z in zero_points)
    assert report["conversion"]["per_channel"] and report["conversion"]["symmetric"]


def test_fp16_keeps_float32_io_and_a_hit_loads_without_building(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path)
    built = pipe.build(BuildRequest("cpu", "fp16"))
    model = onnx.load(str(Path(built["path"]) / "model" / "model.onnx"))
    assert {i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past")} == {1}  # FLOAT
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    hit = pipe.build(BuildRequest("cpu", "fp16"))
    assert hit["cache"] == "hit" and hit["key"] == built["key"] and hit["load_ms"] > 0


def test_a_corrupted_engine_is_quarantined_and_rebuilt(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path)
    first = pipe.build(BuildRequest("cpu", "fp32"))
    graph = Path(first["path"]) / "model" / "model.onnx"
    graph.write_bytes(graph.read_bytes()[:-10] + b"0123456789")
    again = pipe.build(BuildRequest("cpu", "fp32"))
    assert again["cache"] == "built" and again["key"] == first["key"]
    assert len(list(pipe.cache.quarantine_dir.iterdir())) == 1


def test_an_interrupted_build_resumes_from_its_last_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = make_pipeline(tmp_path)
    real_gate = Pipeline._gate

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Pipeline, "_gate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipe.build(BuildRequest("cpu", "int8"))
    monkeypatch.setattr(Pipeline, "_gate", real_gate)
    monkeypatch.setattr(pipeline_mod, "convert", lambda *a, **k: pytest.fail("convert ran again"))
    report = pipe.build(BuildRequest("cpu", "int8"))
    assert report["resumed_steps"] == ["compile", "convert", "reference"]
    assert report["cache"] == "built"


def test_beyond_budget_is_refused_and_not_cached(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path, min_cosine=0.99999999)
    with pytest.raises(GateRefused) as info:
        pipe.build(BuildRequest("cpu", "int8"))
    assert "cosine" in str(info.value) and not info.value.report["accuracy"]["passed"]
    assert pipe.cache.entries() == []


def test_an_empty_calibration_set_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    pipe = make_pipeline(tmp_path, calib=empty)
    with pytest.raises(InputError, match=r"empty\.jsonl: the manifest is empty"):
        pipe.build(BuildRequest("cpu", "int8"))


def test_missing_runtime_names_what_to_install(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path)
    with pytest.raises(BackendUnavailable, match=r"needs tensorrt.*JetPack"):
        pipe.build(BuildRequest("jetson", "fp16"))


def test_profiles_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path)
    shapes = profile_shapes(pipe.recipe, "jetson", pipe.ref.path / "model.onnx")
    assert [name for name, _ in shapes] == ["prefill", "decode"]
    lo, opt, hi = shapes[1][1]["past_key_values.0.key"]
    assert lo[2] == 1 and hi[2] == 127 and lo[0] == 1 and hi[0] == 4
    bad = make_recipe(tmp_path).read_text().replace("past_sequence_length = [0, 0, 0]\n", "", 1)
    (tmp_path / "tiny-phi3.toml").write_text(bad)
    pipe.recipe = load_recipe(tmp_path / "tiny-phi3.toml")
    with pytest.raises(ConfigError, match="past_sequence_length"):
        profile_shapes(pipe.recipe, "jetson", pipe.ref.path / "model.onnx")


def test_manifest_records_key_parts_and_accuracy(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path)
    report = pipe.build(BuildRequest("cpu", "int8", flavour="dynamic"))
    doc = json.loads((Path(report["path"]) / "manifest.json").read_text())
    assert doc["key_parts"]["runtime_version"] == doc["runtime_version"]
    assert doc["key_parts"]["device"].startswith("cpu:")
    assert doc["accuracy"]["flavour"] == "dynamic" and doc["conversion"]["tool"].endswith("quantize_dynamic")


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_methods_calibrate_on_packed_windows(tmp_path: Path, method: str) -> None:
    report = build_gated(make_pipeline(tmp_path), BuildRequest("cpu", "int8", method=method))
    assert report["conversion"]["method"] == method
    assert report["conversion"]["samples"] >= 1


@pytest.mark.parametrize("flavour", ["qdq", "dynamic"])
def test_int8_builds_never_write_into_the_model_folder(tmp_path: Path, flavour: str) -> None:
    """ONNX Runtime's quantizers write a shape-inferred copy beside the model they are given: the
    model's own folder is read-only where the package is installed, and two builds of one model at
    once would delete each other's copy. Creating or removing an entry changes a folder's mtime."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(ROOT / "edge_agent" / "demo_models" / "demo-phi3", model)
    recipe = make_recipe(tmp_path)
    recipe.write_text(recipe.read_text().replace('model = "demo-phi3"', f'model = "{model}"'))
    before = (model.stat().st_mtime_ns, sorted(p.name for p in model.iterdir()))
    pipe = Pipeline(
        load_recipe(recipe),
        EngineCache(tmp_path / "engines", 1 << 30),
        tmp_path / "models",
        threads=1,
        heartbeat=Heartbeat(enabled=False, notifier=Notifier({})),
    )
    report = build_gated(pipe, BuildRequest("cpu", "int8", flavour=flavour))
    assert report["conversion"]["tool"].startswith("onnxruntime.quantization")
    assert (model.stat().st_mtime_ns, sorted(p.name for p in model.iterdir())) == before
