"""ONNX Runtime and OpenVINO sessions on a tiny real ONNX model, checked against numpy."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, TensorSpec, backend_names, is_installed, open_session
from edge_agent.backends.openvino import compile_config
from edge_agent.errors import BackendError, BackendUnavailable, DeviceUnavailable, EngineError, InputError, ModelError
from tests.onnx_models import affine_relu, affine_relu_reference

LOCAL = [b for b in ("onnxruntime", "openvino") if is_installed(b)]


@pytest.fixture
def model(tmp_path):
    return affine_relu(tmp_path / "affine.onnx")


@pytest.mark.parametrize("backend", LOCAL)
def test_session_reports_specs_and_matches_numpy(backend, model):
    path, w, b = model
    session = open_session(path, backend, SessionOptions(device="cpu", threads=1))
    try:
        assert session.backend == backend
        (x_spec,), (y_spec,) = session.inputs, session.outputs
        assert (x_spec.name, x_spec.dtype, x_spec.shape[1]) == ("x", "float32", 8)
        assert (y_spec.name, y_spec.dtype, y_spec.shape[1]) == ("y", "float32", 4)
        for batch in (1, 3, 7):  # dynamic batch
            x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
            y = session.run({"x": x})["y"]
            np.testing.assert_allclose(y, affine_relu_reference(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        session.close()


@pytest.mark.parametrize("backend", LOCAL)
def test_outputs_are_owned_by_the_caller(backend, model):
    path, w, b = model
    session = open_session(path, backend, SessionOptions(device="cpu"))
    x1 = np.ones((2, 8), np.float32)
    y1 = session.run({"x": x1})["y"]
    kept = y1.copy()
    session.run({"x": -x1})
    np.testing.assert_array_equal(y1, kept)  # a later run must not overwrite an earlier result


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize(
    "feeds, match",
    [
        ({"x": np.ones((2, 8), np.float64)}, "dtype float64"),
        ({"x": np.ones((2, 5), np.float32)}, "dim 1 is 5"),
        ({"x": np.ones((8,), np.float32)}, "rank 1"),
        ({"z": np.ones((2, 8), np.float32)}, "unknown input"),
        ({}, "missing input"),
    ],
)
def test_bad_feeds_are_input_errors_naming_the_input(backend, model, feeds, match):
    session = open_session(model[0], backend, SessionOptions(device="cpu"))
    with pytest.raises(InputError, match=match):
        session.run(feeds)


@pytest.mark.parametrize("backend", LOCAL)
def test_missing_and_corrupt_model_files(backend, tmp_path, model):
    with pytest.raises(ModelError, match="not found"):
        open_session(tmp_path / "absent.onnx", backend)
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(model[0].read_bytes()[:40])
    with pytest.raises(EngineError, match="corrupt"):
        open_session(corrupt, backend)


def test_unknown_backend_lists_the_known_ones(model):
    with pytest.raises(BackendError, match=r"unknown backend 'tflite'.*onnxruntime"):
        open_session(model[0], "tflite")
    assert set(backend_names()) >= {"onnxruntime", "openvino", "tensorrt", "fake"}


def test_missing_runtime_names_what_to_install(model, monkeypatch):
    monkeypatch.setattr("edge_agent.backends.is_installed", lambda name: False)
    with pytest.raises(BackendUnavailable, match=r"pip install 'edge-agent\[openvino\]'"):
        open_session(model[0], "openvino")


def test_onnxruntime_absent_device_says_which_build_to_install(model):
    with pytest.raises(DeviceUnavailable, match="onnxruntime-gpu"):
        open_session(model[0], "onnxruntime", SessionOptions(device="cuda"))


@pytest.mark.skipif(not is_installed("openvino"), reason="openvino not installed")
def test_openvino_absent_npu_is_device_unavailable(model):
    import openvino as ov

    if "NPU" in ov.Core().available_devices:
        pytest.skip("this machine has an NPU")
    with pytest.raises(DeviceUnavailable, match="NPU is not present"):
        open_session(model[0], "openvino", SessionOptions(device="NPU"))


@pytest.mark.skipif(not is_installed("openvino"), reason="openvino not installed")
def test_openvino_static_reshape(model):
    path, w, b = model
    session = open_session(path, "openvino", SessionOptions(device="CPU", static_shapes={"x": (3, 8)}))
    assert session.inputs[0].shape == (3, 8) and session.inputs[0].is_static
    with pytest.raises(InputError, match="fixes it at 3"):
        session.run({"x": np.ones((2, 8), np.float32)})


def test_openvino_precision_is_explicit():
    # OpenVINO would pick bf16 on CPUs with bf16 units: fp32/auto must pin f32.
    assert compile_config(SessionOptions())["INFERENCE_PRECISION_HINT"] == "f32"
    assert compile_config(SessionOptions(precision="fp16"))["INFERENCE_PRECISION_HINT"] == "f16"
    cfg = compile_config(SessionOptions(threads=2, cache_dir="/tmp/c"))
    assert cfg["INFERENCE_NUM_THREADS"] == "2" and cfg["CACHE_DIR"] == "/tmp/c/openvino"
    assert cfg["PERFORMANCE_HINT"] == "LATENCY"


def test_fake_backend_latency_failures_and_spec(tmp_path):
    spec = tmp_path / "fake.json"
    spec.write_text(
        '{"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 2]}],'
        ' "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 2]}],'
        ' "latency_ms": 1, "fail_every": 3}'
    )
    session = open_session(spec, "fake", warmup={"x": np.zeros((1, 2), np.float32)})
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(session.run({"x": x})["y"], x + 1)
    with pytest.raises(BackendError, match="injected failure on call 3"):
        session.run({"x": x})
    np.testing.assert_array_equal(session.run({"x": x})["y"], x + 1)  # keeps serving after a failure
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ModelError, match="not valid JSON"):
        open_session(bad, "fake")


def test_tensor_spec_static():
    assert TensorSpec("a", "float32", (1, 3)).is_static
    assert not TensorSpec("a", "float32", ("batch", 3)).is_static


def test_onnxruntime_binding_writes_into_caller_buffers(model):
    path, w, b = model
    session = open_session(path, "onnxruntime", SessionOptions(device="cpu"))
    out = np.full((3, 4), np.nan, np.float32)
    address = out.ctypes.data
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    session.run_with_binding({"x": x}, {"y": out})
    assert out.ctypes.data == address  # same memory, filled in place
    np.testing.assert_allclose(out, affine_relu_reference(x, w, b), rtol=1e-5, atol=1e-5)


def _add_model(path):
    """z = x + k, both [2, 3] float32 inputs."""
    import onnx
    from onnx import TensorProto, helper

    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "k", "z")]
    graph = helper.make_graph([helper.make_node("Add", ["x", "k"], ["z"])], "add", vi[:2], vi[2:])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_onnxruntime_prepared_binding_keeps_fixed_buffers_bound_by_reference(tmp_path):
    session = open_session(_add_model(tmp_path / "add.onnx"), "onnxruntime", SessionOptions(device="cpu"))
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 3)).astype(np.float32)
    z = np.full((2, 3), np.nan, np.float32)
    run = session.prepare_binding({"k": k}, {"z": z})
    for step in range(3):
        x = rng.standard_normal((2, 3)).astype(np.float32)
        run.run({"x": x}, {})
        np.testing.assert_allclose(z, x + k, rtol=1e-6)  # into the bound-once output
        k += np.float32(step + 1)  # the bound input is the caller's memory, not a copy taken at binding
    z2 = np.empty((2, 3), np.float32)  # an output given to one run goes where that run says
    run.run({"x": np.zeros((2, 3), np.float32)}, {"z": z2})
    np.testing.assert_allclose(z2, k, rtol=1e-6)
    with pytest.raises(InputError, match="missing input"):
        session.prepare_binding({}, {"z": z}).run({}, {})
    with pytest.raises(InputError, match="unknown input"):
        run.run({"x": x, "nope": x}, {})
    with pytest.raises(InputError, match="contiguous"):
        session.prepare_binding({"k": np.zeros((3, 2), np.float32).T}, {})


def test_onnxruntime_tensorrt_provider_options_are_keyed_by_runtime_version(monkeypatch, tmp_path):
    import onnxruntime as ort

    from edge_agent.backends.onnxruntime import providers_for

    monkeypatch.setattr(
        ort,
        "get_available_providers",
        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    chosen = providers_for(SessionOptions(device="tensorrt", precision="fp16", cache_dir=tmp_path))
    assert [name for name, _ in chosen] == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    trt = chosen[0][1]
    assert trt["trt_fp16_enable"] is True and trt["trt_int8_enable"] is False
    # The TRT EP never invalidates its cache on upgrade: the folder carries the runtime version.
    assert trt["trt_engine_cache_path"].endswith(f"ort-trt-{ort.__version__}")


@contextlib.contextmanager
def _default_and(model, threads: int, extra: dict):
    """Two sessions of ``model``: default options, and with ``extra``; both must still compute the reference."""
    path, w, b = model
    sessions = [open_session(path, "onnxruntime", SessionOptions(threads=threads, extra=e)) for e in ({}, extra)]
    try:
        yield [s._session.get_session_options() for s in sessions]
        x = np.random.default_rng(threads).standard_normal((3, 8)).astype(np.float32)
        for session in sessions:
            np.testing.assert_allclose(session.run({"x": x})["y"], affine_relu_reference(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        for session in sessions:
            session.close()


def test_onnxruntime_threads_sleep_between_ops_unless_asked_to_spin(model):
    # several sessions share the cores (LLM tiers, the recogniser): a spinning pool takes them from the others
    key = "session.intra_op.allow_spinning"
    with _default_and(model, 2, {"allow_spinning": True}) as (quiet, spinning):
        assert quiet.get_session_config_entry(key) == "0"
        assert spinning.get_session_config_entry(key) == "1"


def test_onnxruntime_runs_without_its_arena_on_request(model):
    # a decoder's buffers vary step to step: without the arena, what a long prompt took goes back when done
    with _default_and(model, 1, {"cpu_arena": False}) as (pooled, arena_off):
        assert pooled.enable_cpu_mem_arena is True
        assert arena_off.enable_cpu_mem_arena is False


def test_onnxruntime_interrupt_stops_runs_until_resumed(model):
    """``interrupt`` (ONNX Runtime's terminate flag, any thread) fails the run in progress and every later one
    with ``Interrupted`` until ``resume``; then runs are right again."""
    from edge_agent.errors import Interrupted

    path, w, b = model
    session = open_session(path, "onnxruntime", SessionOptions(device="cpu", threads=1))
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    session.interrupt()
    with pytest.raises(Interrupted, match="interrupted"):
        session.run({"x": x})
    out = np.zeros((3, 4), np.float32)
    with pytest.raises(Interrupted):
        session.run_with_binding({"x": x}, {"y": out})
    session.resume()
    np.testing.assert_allclose(session.run({"x": x})["y"], affine_relu_reference(x, w, b), rtol=1e-5, atol=1e-5)
    session.run_with_binding({"x": x}, {"y": out})
    np.testing.assert_allclose(out, affine_relu_reference(x, w, b), rtol=1e-5, atol=1e-5)
