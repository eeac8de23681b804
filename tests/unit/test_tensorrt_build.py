"""The TensorRT plan builder against the fake ``tensorrt`` (10.3 and 11.4 surfaces), no GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.engines.tensorrt_build import BuildSpec, build_plan, entropy_calibrator, is_strongly_typed_only
from edge_agent.errors import BackendError, InputError
from tests.fakes import fake_tensorrt
from tests.fakes.fake_cuda import FakeCuda

PROFILES = [("prefill", {"x": ((1, 4), (2, 4), (8, 4))}), ("decode", {"x": ((16, 4), (16, 4), (32, 4))})]


def model(path: Path, zero_point: int = 0, qdq: bool = False, fp16: bool = False) -> Path:
    """y = x @ W, x: float32 [batch, 4]; optionally with a Q/DQ pair on x, or fp16 weights."""
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    nodes, inits = [], [numpy_helper.from_array(w.astype(np.float16) if fp16 else w, "W")]
    src = "x"
    if qdq:
        inits += [
            numpy_helper.from_array(np.array(0.05, np.float32), "s"),
            numpy_helper.from_array(np.array(zero_point, np.int8), "zp"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xdq"]),
        ]
        src = "xdq"
    if fp16:
        nodes.append(helper.make_node("Cast", [src], ["xh"], to=TensorProto.FLOAT16))
        nodes += [helper.make_node("MatMul", ["xh", "W"], ["yh"]), helper.make_node("Cast", ["yh"], ["y"], to=1)]
    else:
        nodes.append(helper.make_node("MatMul", [src, "W"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


@pytest.fixture(params=["10.3.0.26", "11.4.0"])
def trt(request):
    return fake_tensorrt.as_version(request.param)


def plan_doc(path: Path) -> dict:
    return json.loads(path.read_bytes())


def test_versions() -> None:
    assert not is_strongly_typed_only("10.3.0.26") and is_strongly_typed_only("11.4.0")
    with pytest.raises(BackendError):
        is_strongly_typed_only("weird")


def test_fp32_builds_both_profiles_and_persists_the_timing_cache(tmp_path: Path, trt) -> None:
    cache = tmp_path / "timing" / "t.cache"
    spec = BuildSpec(model(tmp_path / "m.onnx"), tmp_path / "m.plan", "fp32", PROFILES, cache)
    first = build_plan(trt, spec)
    assert first["profiles"] == ["prefill", "decode"] and not first["timing_cache_reused"]
    doc = plan_doc(spec.plan)
    assert doc["version"] == trt.__version__
    assert doc["profiles"] == [{"x": [[1, 4], [2, 4], [8, 4]]}, {"x": [[16, 4], [16, 4], [32, 4]]}]
    assert doc["build"]["flags"] == [] and doc["build"]["workspace"] == 1 << 30
    assert doc["build"]["strongly_typed"] == is_strongly_typed_only(trt.__version__)
    entries = json.loads(cache.read_bytes())["entries"]
    second = build_plan(trt, spec)
    assert second["timing_cache_reused"] and json.loads(cache.read_bytes())["entries"] > entries


def test_fp16_uses_the_flag_on_10_and_the_graph_on_11(tmp_path: Path, trt) -> None:
    eleven = is_strongly_typed_only(trt.__version__)
    onnx_path = model(tmp_path / "m.onnx", fp16=eleven)  # the pipeline hands 11.x an FP16 graph
    out = build_plan(trt, BuildSpec(onnx_path, tmp_path / "m.plan", "fp16", PROFILES))
    doc = plan_doc(tmp_path / "m.plan")
    if eleven:
        assert out["builder_flags"] == [] and doc["build"]["has_fp16_weights"] and doc["build"]["strongly_typed"]
    else:
        assert out["builder_flags"] == ["FP16"] and doc["build"]["flags"] == ["FP16"]


def test_int8_from_symmetric_qdq_is_strongly_typed_without_flags(tmp_path: Path, trt) -> None:
    out = build_plan(trt, BuildSpec(model(tmp_path / "m.onnx", qdq=True), tmp_path / "m.plan", "int8", PROFILES))
    assert out["strongly_typed"] and out["builder_flags"] == [] and out["calibrator"] is None
    assert plan_doc(tmp_path / "m.plan")["build"]["strongly_typed"]


def test_asymmetric_qdq_is_rejected_by_the_parser(tmp_path: Path, trt) -> None:
    spec = BuildSpec(model(tmp_path / "m.onnx", qdq=True, zero_point=3), tmp_path / "m.plan", "int8", PROFILES)
    with pytest.raises(InputError, match="symmetric quantization"):
        build_plan(trt, spec)


def test_legacy_entropy_calibrator_only_before_11(tmp_path: Path, trt) -> None:
    feeds = [{"x": np.full((1, 4), i, np.float32)} for i in range(3)]
    if is_strongly_typed_only(trt.__version__):
        with pytest.raises(InputError, match="no IInt8EntropyCalibrator2"):
            entropy_calibrator(trt, FakeCuda(), feeds, tmp_path / "calib.cache")
        spec = BuildSpec(model(tmp_path / "m.onnx"), tmp_path / "m.plan", "int8", PROFILES, calibrator=object())
        with pytest.raises(InputError, match="removed the implicit INT8 calibrator"):
            build_plan(trt, spec)
        return
    calib = entropy_calibrator(trt, FakeCuda(), feeds, tmp_path / "calib.cache")
    assert isinstance(calib, trt.IInt8EntropyCalibrator2)
    out = build_plan(
        trt, BuildSpec(model(tmp_path / "m.onnx"), tmp_path / "m.plan", "int8", PROFILES, calibrator=calib)
    )
    assert out["builder_flags"] == ["INT8", "FP16"] and not out["strongly_typed"]
    assert plan_doc(tmp_path / "m.plan")["build"]["calibration_batches"] == 3
    assert json.loads((tmp_path / "calib.cache").read_bytes()) == {"batches": 3}


def test_profile_mismatches_are_clear_errors(tmp_path: Path, trt) -> None:
    onnx_path = model(tmp_path / "m.onnx")
    with pytest.raises(InputError, match=r"unknown inputs \['input_ids'\]"):
        build_plan(trt, BuildSpec(onnx_path, tmp_path / "m.plan", "fp32", [("p", {"input_ids": ((1,), (1,), (1,))})]))
    with pytest.raises(InputError, match="rejected profile"):
        build_plan(trt, BuildSpec(onnx_path, tmp_path / "m.plan", "fp32", [("p", {"x": ((8, 4), (2, 4), (1, 4))})]))
    with pytest.raises(BackendError, match="do not match the network"):
        build_plan(trt, BuildSpec(onnx_path, tmp_path / "m.plan", "fp32", [("p", {"x": ((1, 5), (2, 5), (8, 5))})]))
    with pytest.raises(InputError, match="at least one shape profile"):
        build_plan(trt, BuildSpec(onnx_path, tmp_path / "m.plan", "fp32", []))


def test_unparseable_onnx_names_the_file(tmp_path: Path, trt) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(InputError, match=r"could not parse .*bad\.onnx"):
        build_plan(trt, BuildSpec(bad, tmp_path / "m.plan", "fp32", PROFILES))


def test_progress_monitor_reports_phases(tmp_path: Path, trt) -> None:
    seen = []
    build_plan(
        trt,
        BuildSpec(model(tmp_path / "m.onnx"), tmp_path / "m.plan", "fp32", PROFILES),
        progress=lambda phase, done, total: seen.append((phase, done, total)),
    )
    assert seen[0] == ("Building engine", 0, 2) and seen[-1] == ("Building engine", 2, 2)


def test_a_10_3_plan_loads_in_the_runtime_with_its_profiles(tmp_path: Path) -> None:
    trt = fake_tensorrt.as_version(fake_tensorrt.__version__)
    build_plan(trt, BuildSpec(model(tmp_path / "m.onnx"), tmp_path / "m.plan", "fp32", PROFILES))
    logger = fake_tensorrt.Logger()
    engine = fake_tensorrt.Runtime(logger).deserialize_cuda_engine((tmp_path / "m.plan").read_bytes())
    assert engine is not None and engine.num_optimization_profiles == 2
    assert [tuple(d) for d in engine.get_tensor_profile_shape("x", 1)] == [(16, 4), (16, 4), (32, 4)]
