"""Tiny ONNX graphs built with onnx.helper for backend tests, each with a numpy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def affine_relu(path: Path, in_dim: int = 8, out_dim: int = 4, seed: int = 0) -> tuple[Path, np.ndarray, np.ndarray]:
    """y = relu(x @ W + b) with a dynamic batch; returns (path, W, b)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((in_dim, out_dim)).astype(np.float32)
    b = rng.standard_normal(out_dim).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["pre"]),
            helper.make_node("Relu", ["pre"], ["y"]),
        ],
        "affine_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", in_dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_dim])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path, w, b


def affine_relu_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w + b, 0.0)
