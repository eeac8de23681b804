"""The numpy 4-bit methods through quantize_matmul_nbits on small graphs: every weight MatMul becomes
MatMulNBits with uint8 zero points, and ONNX Runtime's output is numpy's matmul on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.engines import int4_methods as im
from edge_agent.engines.quantize_weight_only import quantize_matmul_nbits
from edge_agent.errors import InputError


def _two_matmuls(path: Path, w1: np.ndarray, w2: np.ndarray) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", w1.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", w2.shape[1]])
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="model.layers.0.mm"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="lm_head/MatMul"),
    ]
    inits = [numpy_helper.from_array(w1, "model.layers.0.w1"), numpy_helper.from_array(w2, "w2")]
    nodes[0].input[1] = "model.layers.0.w1"
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("method", ["kquant", "rtn_asym", "hqq"])
def test_a_numpy_method_writes_matmul_nbits_that_onnxruntime_runs_as_numpy_does(tmp_path: Path, method: str) -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(5)
    w1, w2 = rng.normal(size=(64, 96)).astype(np.float32), rng.normal(size=(96, 40)).astype(np.float32)
    _two_matmuls(tmp_path / "m.onnx", w1, w2)
    info = quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "q.onnx", 4, 32, algorithm=method, head_bits=8)
    assert info["matmuls_4bit"] == 1 and info["matmuls_8bit"] == 1 and info["head"]["bits"] == 8
    model = onnx.load(str(tmp_path / "q.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and len(nbits[0].input) == 4  # the 4-bit one carries its uint8 zero points
    x = rng.normal(size=(3, 64)).astype(np.float32)
    y = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    d1 = im.quantize(w1, 4, 32, method).dequantize()
    d2 = im.quantize(w2, 8, 32, "rtn").dequantize()  # the head at 8 bits: ONNX Runtime's symmetric blocks
    np.testing.assert_allclose(y, (x.astype(np.float64) @ d1) @ d2, rtol=1e-3, atol=1e-3)


def test_bad_method_input_is_one_line_naming_the_key(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    _two_matmuls(tmp_path / "m.onnx", rng.normal(size=(64, 32)).astype(np.float32), np.ones((32, 8), np.float32))
    for kwargs, key in (
        ({"algorithm": "awq"}, "weight_only.algorithm"),
        ({"algorithm": "gptq"}, "weight_only.calibration"),
        ({"algorithm": "kquant", "mixed_budget_pct": 5.0}, "weight_only.calibration"),
        ({"algorithm": "kquant", "block_size": 24}, "weight_only.block_size"),
    ):
        with pytest.raises(InputError, match=key):
            quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "q.onnx", 4, **kwargs)
