"""Real TensorRT and real CUDA, behind the ``gpu`` marker; skipped with a reason where absent.

Whether a GPU and TensorRT are here is asked in child processes (a TensorRT import or deserialize
without a working GPU can segfault). The TensorRT scenario itself also runs in a child: this file
doubles as its script (``python test_tensorrt_real.py WORKDIR``), printing one JSON line.

The tiny ONNX model (y = x * 2 + 1, x: float32 [batch, 4]) is encoded by hand, so the device
needs neither the ``onnx`` package nor torch; ``test_tiny_onnx_model_runs_on_onnxruntime`` checks
it (onnx.checker where onnx is installed, and ONNX Runtime on the CPU) on every machine.
"""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROFILES = (((1, 4), (4, 4), (8, 4)), ((16, 4), (24, 4), (32, 4)))


# -- a minimal protobuf writer for ModelProto (field numbers from onnx/onnx.proto) ------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _msg(field: int, payload: bytes | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _value_info(name: str, dims: tuple[int | str, ...]) -> bytes:
    shape = b"".join(_msg(1, _int(1, d) if isinstance(d, int) else _msg(2, d)) for d in dims)
    tensor_type = _int(1, 1) + _msg(2, shape)  # elem_type FLOAT, shape
    return _msg(1, name) + _msg(2, _msg(1, tensor_type))


def _scalar(name: str, value: float) -> bytes:
    return _int(2, 1) + _msg(8, name) + _msg(9, struct.pack("<f", value))  # FLOAT, no dims = scalar


def tiny_onnx() -> bytes:
    nodes = (
        _msg(1, "x") + _msg(1, "two") + _msg(2, "t") + _msg(4, "Mul"),
        _msg(1, "t") + _msg(1, "one") + _msg(2, "y") + _msg(4, "Add"),
    )
    graph = (
        b"".join(_msg(1, n) for n in nodes)
        + _msg(2, "affine")
        + _msg(5, _scalar("two", 2.0))
        + _msg(5, _scalar("one", 1.0))
        + _msg(11, _value_info("x", ("batch", 4)))
        + _msg(12, _value_info("y", ("batch", 4)))
    )
    return _int(1, 8) + _msg(2, "edge-agent-tests") + _msg(7, graph) + _msg(8, _msg(1, "") + _int(2, 13))


# -- what this machine has, asked in children ------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cuda_devices() -> tuple[int, str]:
    from edge_agent.backends.probe import run_probe
    from edge_agent.diagnostics.doctor import _CUDA_CODE

    run = run_probe(_CUDA_CODE, timeout_s=60)
    if run.error:
        return 0, run.error
    return len(run.data.get("devices", [])), run.data.get("error", "no CUDA device")


@functools.lru_cache(maxsize=1)
def _tensorrt() -> dict:
    from edge_agent.backends.tensorrt import probe_tensorrt

    return probe_tensorrt(timeout_s=60)


def _need_gpu() -> None:
    count, why = _cuda_devices()
    if count == 0:
        pytest.skip(f"needs an NVIDIA GPU; CUDA probe says: {why}")


def _need_tensorrt() -> None:
    _need_gpu()
    probe = _tensorrt()
    if not probe["installed"] or probe["error"]:
        pytest.skip(f"TensorRT unavailable: {probe['error'] or 'not installed (it comes from JetPack)'}")


# -- tests -------------------------------------------------------------------------------------------


def test_tiny_onnx_model_runs_on_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    try:
        import onnx
    except ImportError:
        pass
    else:
        onnx.checker.check_model(onnx.load_model_from_string(tiny_onnx()), full_check=True)
    session = ort.InferenceSession(tiny_onnx(), providers=["CPUExecutionProvider"])
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x * 2 + 1)


@pytest.mark.gpu
def test_cuda_python_round_trip_with_events() -> None:
    _need_gpu()
    from edge_agent.backends.cuda import select_cuda
    from edge_agent.errors import BackendError

    cuda = select_cuda("cuda-python")
    assert cuda.device_count() >= 1 and cuda.device_name(0)
    assert cuda.compute_capability(0) >= (5, 0)
    stream, start, end = cuda.stream(), cuda.event(), cuda.event()
    buffer = cuda.malloc(4096)
    src, dst = cuda.pinned((1024,), np.float32), cuda.pinned((32, 32), np.float32)
    try:
        src[:] = np.arange(1024, dtype=np.float32)
        dst[:] = -1
        cuda.record(start, stream)
        cuda.copy_htod_async(buffer, src, stream)
        cuda.copy_dtoh_async(dst, buffer, stream)
        cuda.record(end, stream)
        stream.synchronize()
        np.testing.assert_array_equal(dst.reshape(-1), src)
        assert 0 <= cuda.elapsed_ms(start, end) < 10_000
        with pytest.raises(BackendError, match="does not fit"):
            cuda.copy_htod_async(buffer, np.zeros(2048, dtype=np.float32), stream)
    finally:
        buffer.free()
        buffer.free()  # idempotent
        cuda.free_pinned(src)
        cuda.free_pinned(dst)
        for handle in (start, end, stream):
            handle.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_tensorrt_engine_built_here_matches_numpy(tmp_path: Path) -> None:
    _need_tensorrt()
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), **_env()},
    )
    assert proc.returncode == 0, f"scenario exited {proc.returncode}: {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_error"] <= 1e-5, result
    assert result["profiles_used"] == [0, 0, 0, 1], result
    assert result["out_of_profile"] == "InputError", result
    assert result["mallocs_after_open"] == 0, result
    assert result["gpu_ms"] >= 0


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _scenario(workdir: Path) -> dict:
    import tensorrt as trt

    from edge_agent.backends import SessionOptions
    from edge_agent.backends import tensorrt as backend
    from edge_agent.backends.cuda import select_cuda
    from edge_agent.errors import InputError

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10+
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(tiny_onnx()):
        raise SystemExit("ONNX parse failed: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    for lo, opt, hi in PROFILES:
        profile = builder.create_optimization_profile()
        profile.set_shape("x", lo, opt, hi)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise SystemExit("engine build failed")
    path = workdir / "affine.plan"
    path.write_bytes(bytes(plan))

    cuda = select_cuda()
    mallocs = 0
    real_malloc = cuda.malloc

    def counting_malloc(nbytes: int):
        nonlocal mallocs
        mallocs += 1
        return real_malloc(nbytes)

    session = backend.open(path, SessionOptions(device="cuda", extra={"cuda": cuda}))
    cuda.malloc = counting_malloc  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    errors, used = [], []
    for batch in (1, 8, 3, 20):
        x = rng.standard_normal((batch, 4)).astype(np.float32)
        errors.append(float(np.max(np.abs(session.run({"x": x})["y"] - (x * 2 + 1)))))
        used.append(session._context.active_optimization_profile)
    try:
        session.run({"x": np.zeros((12, 4), dtype=np.float32)})
        outside = "accepted"
    except InputError:
        outside = "InputError"
    result = {
        "max_abs_error": max(errors),
        "profiles_used": used,
        "out_of_profile": outside,
        "mallocs_after_open": mallocs,
        "gpu_ms": session.last_gpu_ms,
        "tensorrt": trt.__version__,
    }
    session.close()
    session.close()
    return result


if __name__ == "__main__":
    print(json.dumps(_scenario(Path(sys.argv[1]))))
