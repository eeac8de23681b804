"""The TensorRT session against a fake ``tensorrt`` module and a fake CUDA layer (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import edge_agent.backends.tensorrt as trt_backend
from edge_agent.backends import SessionOptions, open_session
from edge_agent.errors import BackendError, DeviceUnavailable, EngineError, InputError, ModelError
from tests.fakes import fake_tensorrt
from tests.fakes.fake_cuda import FakeCuda

AFFINE = {"y": {"input": "x", "scale": 2, "bias": 1}}


def io(name: str, mode: str, shape: list[int], dtype: str = "FLOAT") -> dict:
    return {"name": name, "mode": mode, "dtype": dtype, "shape": shape}


@pytest.fixture(autouse=True)
def fake_trt(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    return fake_tensorrt


@pytest.fixture
def cuda() -> FakeCuda:
    return FakeCuda()


def load(tmp_path: Path, plan: bytes, cuda: FakeCuda, name: str = "model.plan") -> trt_backend.TensorRTSession:
    path = tmp_path / name
    path.write_bytes(plan)
    return trt_backend.open(path, SessionOptions(device="cuda", extra={"cuda": cuda}))


def affine_plan(profiles: list[dict] | None = None) -> bytes:
    return fake_tensorrt.make_plan(
        [io("x", "INPUT", [-1, 4]), io("y", "OUTPUT", [-1, 4])], profiles or [{"x": [[1, 4], [4, 4], [8, 4]]}], AFFINE
    )


def assert_nothing_left(cuda: FakeCuda) -> None:
    assert cuda.live == {} and cuda.pinned_live == 0 and cuda.streams_open == 0 and cuda.events_open == 0


def test_corrupt_plan_is_an_engine_error_naming_the_file(tmp_path: Path, cuda: FakeCuda) -> None:
    with pytest.raises(EngineError) as err:
        load(tmp_path, b"\x00not a plan", cuda, "broken.plan")
    message = str(err.value)
    assert str(tmp_path / "broken.plan") in message
    assert "corrupt" in message and "another TensorRT version or GPU" in message
    assert "Magic tag does not match" in message  # TensorRT's own log line is carried over
    assert_nothing_left(cuda)


def test_plan_from_another_tensorrt_version_is_an_engine_error(tmp_path: Path, cuda: FakeCuda) -> None:
    plan = fake_tensorrt.make_plan(
        [io("x", "INPUT", [1, 4]), io("y", "OUTPUT", [1, 4])], ops=AFFINE, version="10.16.0.72"
    )
    with pytest.raises(EngineError, match="not compatible with this version of TensorRT"):
        load(tmp_path, plan, cuda)


def test_missing_plan_file_is_a_model_error(tmp_path: Path, cuda: FakeCuda) -> None:
    with pytest.raises(ModelError, match=r"nothing\.plan"):
        trt_backend.open(tmp_path / "nothing.plan", SessionOptions(extra={"cuda": cuda}))


def test_no_gpu_fails_before_any_deserialize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_device(*_args: object) -> None:
        raise DeviceUnavailable("no usable CUDA device: cudaGetDeviceCount failed with cudaErrorNoDevice")

    def must_not_run(*_args: object) -> None:
        raise AssertionError("deserialize_cuda_engine without a GPU segfaults the real TensorRT")

    monkeypatch.setattr(trt_backend, "select_cuda", no_device)
    monkeypatch.setattr(fake_tensorrt.Runtime, "deserialize_cuda_engine", must_not_run)
    (tmp_path / "m.plan").write_bytes(affine_plan())
    with pytest.raises(DeviceUnavailable, match="cudaErrorNoDevice"):
        trt_backend.open(tmp_path / "m.plan", SessionOptions(device="cuda"))


def test_io_specs_come_from_the_engine(tmp_path: Path, cuda: FakeCuda) -> None:
    plan = fake_tensorrt.make_plan(
        [
            io("input_ids", "INPUT", [1, -1], "INT64"),
            io("mask", "INPUT", [1, -1], "BOOL"),
            io("logits", "OUTPUT", [1, -1], "HALF"),
        ],
        [{"input_ids": [[1, 1], [1, 16], [1, 64]], "mask": [[1, 1], [1, 16], [1, 64]]}],
        {"logits": {"input": "input_ids", "scale": 0.5}},
    )
    session = load(tmp_path, plan, cuda)
    assert [(s.name, s.dtype, s.shape) for s in session.inputs] == [
        ("input_ids", "int64", (1, None)),
        ("mask", "bool", (1, None)),
    ]
    assert [(s.name, s.dtype, s.shape) for s in session.outputs] == [("logits", "float16", (1, None))]
    assert session.profiles == ({"input_ids": ((1, 1), (1, 16), (1, 64)), "mask": ((1, 1), (1, 16), (1, 64))},)
    assert session.backend == "tensorrt"
    session.close()


def test_buffers_are_sized_for_the_profile_max_and_never_reallocated(tmp_path: Path, cuda: FakeCuda) -> None:
    session = load(tmp_path, affine_plan(), cuda)
    assert sorted(cuda.live.values()) == [8 * 4 * 4, 8 * 4 * 4]  # x and y at the max batch of 8
    allocations = cuda.malloc_calls
    rng = np.random.default_rng(0)
    for batch in (1, 8, 3, 5):
        x = rng.standard_normal((batch, 4)).astype(np.float32)
        y = session.run({"x": x})["y"]
        assert y.shape == (batch, 4) and y.dtype == np.float32
        np.testing.assert_allclose(y, x * 2 + 1, rtol=1e-6)
    assert cuda.malloc_calls == allocations
    assert session.last_gpu_ms is not None and session.last_gpu_ms >= 0
    session.close()


def test_outputs_match_numpy_for_each_io_type(tmp_path: Path, cuda: FakeCuda) -> None:
    plan = fake_tensorrt.make_plan(
        [
            io("x", "INPUT", [2, 3]),
            io("ids", "INPUT", [-1], "INT64"),
            io("h", "INPUT", [2], "HALF"),
            io("b", "INPUT", [4], "BF16"),
            io("y", "OUTPUT", [2, 3]),
            io("ids_next", "OUTPUT", [-1], "INT64"),
            io("h2", "OUTPUT", [2], "HALF"),
            io("b2", "OUTPUT", [4], "BF16"),
        ],
        [{"ids": [[1], [4], [16]]}],
        {
            "y": {"input": "x", "scale": 2, "bias": 1},
            "ids_next": {"input": "ids", "bias": 3},
            "h2": {"input": "h", "scale": -1},
            "b2": {"input": "b", "scale": 2, "bias": 1},
        },
    )
    session = load(tmp_path, plan, cuda)
    # bf16 IO is float32 at the API: numpy has no bfloat16.
    assert {s.name: s.dtype for s in session.inputs}["b"] == "float32"
    feeds = {
        "x": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ids": np.array([5, 7, 9], dtype=np.int64),
        "h": np.array([0.5, -2.0], dtype=np.float16),
        "b": np.array([1.0, -3.0, 0.25, 96.0], dtype=np.float32),
    }
    out = session.run(feeds)
    np.testing.assert_array_equal(out["y"], feeds["x"] * 2 + 1)
    np.testing.assert_array_equal(out["ids_next"], feeds["ids"] + 3)
    assert out["ids_next"].dtype == np.int64 and out["h2"].dtype == np.float16 and out["b2"].dtype == np.float32
    np.testing.assert_array_equal(out["h2"], -feeds["h"])
    np.testing.assert_array_equal(out["b2"], feeds["b"] * 2 + 1)
    assert list(session.run(feeds, output_names=["h2"])) == ["h2"]
    with pytest.raises(InputError, match="unknown output"):
        session.run(feeds, output_names=["nope"])
    session.close()


def test_bf16_inputs_round_to_nearest_even() -> None:
    values = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, np.inf, np.nan], dtype=np.float32)
    back = trt_backend._from_bf16(trt_backend._to_bf16(values))
    assert back[0] == 1.0 and back[1] == 1.0 + 2**-6  # ties go to the even mantissa
    assert np.signbit(back[2]) and np.isinf(back[3]) and np.isnan(back[4])


def test_first_profile_that_holds_the_shapes_is_chosen(tmp_path: Path, cuda: FakeCuda) -> None:
    prefill = {"x": [[1, 2], [1, 32], [1, 64]]}
    decode = {"x": [[1, 1], [4, 1], [8, 1]]}
    plan = fake_tensorrt.make_plan([io("x", "INPUT", [-1, -1]), io("y", "OUTPUT", [-1, -1])], [prefill, decode], AFFINE)
    session = load(tmp_path, plan, cuda)
    assert sorted(cuda.live.values()) == [64 * 4, 64 * 4]  # the larger of the two profile maxima
    context = session._context
    for shape, profile in (((1, 16), 0), ((4, 1), 1), ((1, 2), 0), ((1, 1), 1), ((1, 1), 1)):
        x = np.full(shape, 3.0, dtype=np.float32)
        np.testing.assert_array_equal(session.run({"x": x})["y"], x * 2 + 1)
        assert context.active_optimization_profile == profile, shape
    session.close()


def test_shape_outside_every_profile_is_an_input_error_listing_them(tmp_path: Path, cuda: FakeCuda) -> None:
    plan = affine_plan([{"x": [[1, 4], [2, 4], [8, 4]]}, {"x": [[16, 4], [16, 4], [32, 4]]}])
    session = load(tmp_path, plan, cuda)
    with pytest.raises(InputError) as err:
        session.run({"x": np.zeros((12, 4), dtype=np.float32)})
    assert "profile 0: x (1, 4)..(8, 4)" in str(err.value) and "profile 1: x (16, 4)..(32, 4)" in str(err.value)
    assert session.run({"x": np.ones((20, 4), dtype=np.float32)})["y"].shape == (20, 4)
    session.close()


@pytest.mark.parametrize(
    "feeds, match",
    [
        ({"x": np.zeros((2, 4), dtype=np.float64)}, "dtype float64"),
        ({"x": np.zeros((2, 5), dtype=np.float32)}, "dim 1 is 5"),
        ({"x": np.zeros((2, 4), dtype=np.float32), "z": np.zeros(1)}, "unknown input"),
        ({}, "missing input"),
    ],
)
def test_malformed_feeds_are_input_errors(tmp_path: Path, cuda: FakeCuda, feeds: dict, match: str) -> None:
    session = load(tmp_path, affine_plan(), cuda)
    with pytest.raises(InputError, match=match):
        session.run(feeds)
    session.close()


def test_fp8_io_is_refused_at_open(tmp_path: Path, cuda: FakeCuda) -> None:
    plan = fake_tensorrt.make_plan([io("x", "INPUT", [4], "FP8"), io("y", "OUTPUT", [4])], ops=AFFINE)
    with pytest.raises(EngineError, match="'x' has TensorRT type FP8"):
        load(tmp_path, plan, cuda)
    assert_nothing_left(cuda)


def test_failed_execution_carries_tensorrt_message(
    tmp_path: Path, cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = load(tmp_path, affine_plan(), cuda)
    monkeypatch.setattr(
        fake_tensorrt.IExecutionContext,
        "execute_async_v3",
        lambda self, handle: self._error("Error Code 1: Cuda Runtime (an illegal memory access)"),
    )
    with pytest.raises(BackendError, match="illegal memory access"):
        session.run({"x": np.zeros((1, 4), dtype=np.float32)})
    session.close()


def test_close_frees_everything_and_is_idempotent(tmp_path: Path, cuda: FakeCuda) -> None:
    session = load(tmp_path, affine_plan(), cuda)
    session.run({"x": np.zeros((2, 4), dtype=np.float32)})
    session.close()
    assert_nothing_left(cuda)
    session.close()
    assert_nothing_left(cuda)
    with pytest.raises(BackendError, match="closed"):
        session.run({"x": np.zeros((2, 4), dtype=np.float32)})


def test_open_session_registry_path_with_generic_warmup(tmp_path: Path, cuda: FakeCuda) -> None:
    path = tmp_path / "m.plan"
    path.write_bytes(affine_plan())
    session = open_session(path, "tensorrt", SessionOptions(device="cuda", extra={"cuda": cuda}))
    try:
        assert session._context.executions == 1  # the warm-up ran once, at batch 1
        np.testing.assert_array_equal(session.run({"x": np.ones((2, 4), np.float32)})["y"], np.full((2, 4), 3.0))
    finally:
        session.close()


def test_tensorrt_logger_goes_to_python_logging(
    tmp_path: Path, cuda: FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("ERROR", logger="edge_agent.backends.tensorrt.trt"), pytest.raises(EngineError):
        load(tmp_path, b"junk", cuda)
    assert any("Magic tag does not match" in r.getMessage() for r in caplog.records)


def test_generic_warmup_uses_the_first_profiles_minimum_shapes(tmp_path: Path, cuda: FakeCuda) -> None:
    # A prefill profile that starts at 2 rows: a warm-up with 1 row would be refused by the engine.
    path = tmp_path / "min2.plan"
    path.write_bytes(affine_plan([{"x": [[2, 4], [4, 4], [8, 4]]}]))
    session = open_session(path, "tensorrt", SessionOptions(device="cuda", extra={"cuda": cuda}))
    assert session.warmup_feeds()["x"].shape == (2, 4)
    np.testing.assert_allclose(session.run({"x": np.ones((3, 4), np.float32)})["y"], np.full((3, 4), 3.0))
    session.close()
