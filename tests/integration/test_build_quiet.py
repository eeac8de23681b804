"""A real INT8 build (ONNX Runtime Q/DQ, NNCF) leaves stdout and stderr to us: the quantizers' own
progress bars, logs and numpy warnings go to the debug log."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from edge_agent.engines.pipeline import BuildRequest, GateRefused
from tests.integration import test_build_asr, test_build_onnxruntime

FLAVOURS = [("onnxruntime", "qdq"), ("onnxruntime", "dynamic"), ("openvino", "nncf"), ("openvino", "weights")]
PIPELINES = {"llm": test_build_onnxruntime.make_pipeline, "asr": test_build_asr.make_pipeline}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "backend", "flavour"),
    [("llm", b, f) for b, f in FLAVOURS] + [("asr", "onnxruntime", "qdq"), ("asr", "openvino", "nncf")],
)
def test_int8_build_prints_nothing_of_its_own(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    workload: str,
    backend: str,
    flavour: str,
) -> None:
    if backend == "openvino" and not (importlib.util.find_spec("openvino") and importlib.util.find_spec("nncf")):
        pytest.skip("openvino and nncf (the openvino and build extras) are not installed")
    pipe = PIPELINES[workload](tmp_path)  # progress off: anything on stdout/stderr would be a third party's
    caplog.set_level(logging.DEBUG, logger="edge_agent.engines.quiet")
    try:
        report = pipe.build(BuildRequest("cpu", "int8", backend, flavour))
    except GateRefused as exc:  # the demo model's accuracy is not the point here
        report = exc.report
    out, err = capfd.readouterr()
    assert report["conversion"]["tool"]  # the quantizer really ran
    assert out == ""
    assert err == ""
