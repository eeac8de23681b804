"""fuse_matmuls on quantized graphs: the MatMulNBits siblings that read one input become one node and a Split
whose outputs ONNX Runtime computes exactly as the separate nodes did; a weight-only build fuses them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.engines import int4_methods as im
from edge_agent.engines import quantize_weight_only as qwo
from edge_agent.engines.fuse_matmuls import fuse_sibling_matmuls

K = 64
WIDTHS = {"q": 96, "k": 32, "v": 32, "gate": 48, "up": 48}


def _layer(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """x -> q, k, v (three siblings); x -> relu -> gate, up (two more, on another input); o = q @ w_o (alone)."""
    weights = {name: rng.normal(size=(K, n)).astype(np.float32) for name, n in WIDTHS.items()}
    weights["o"] = rng.normal(size=(WIDTHS["q"], 40)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    for name in WIDTHS:
        src = "x" if name in ("q", "k", "v") else "r"
        nodes.append(helper.make_node("MatMul", [src, f"w_{name}"], [name], name=f"layers.0/{name}/MatMul"))
    nodes.append(helper.make_node("MatMul", ["q", "w_o"], ["o"], name="layers.0/o/MatMul"))
    outputs = [*WIDTHS, "o"]
    graph = helper.make_graph(
        nodes,
        "layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", K])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", None]) for n in outputs],
        [numpy_helper.from_array(w, f"w_{name}") for name, w in weights.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return weights


def _run(path: Path, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize(
    ("bits", "algorithm", "level"),
    [(4, "rtn", 4), (4, "rtn_asym", 4), (4, "kquant", 0), (8, "rtn", 4), (8, "rtn", 0)],
)
def test_fused_siblings_give_the_separate_nodes_outputs_bit_for_bit(tmp_path, monkeypatch, bits, algorithm, level):
    rng = np.random.default_rng(bits + level)
    _layer(tmp_path / "m.onnx", rng)
    with monkeypatch.context() as m:  # the build as it was before fusing: one node per matmul
        m.setattr(qwo, "fuse_sibling_matmuls", lambda model: 0)
        qwo.quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "apart.onnx", bits, 32, True, level, algorithm)
    model = onnx.load(str(tmp_path / "apart.onnx"))
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 6
    assert fuse_sibling_matmuls(model) == 2  # q, k, v and gate, up; o reads its own input
    kinds = [n.op_type for n in model.graph.node]
    assert kinds.count("MatMulNBits") == 3 and kinds.count("Split") == 2
    onnx.save(model, str(tmp_path / "fused.onnx"))
    x = rng.normal(size=(3, K)).astype(np.float32)
    for apart, fused in zip(_run(tmp_path / "apart.onnx", x), _run(tmp_path / "fused.onnx", x), strict=True):
        np.testing.assert_array_equal(fused, apart)


def test_a_weight_only_build_fuses_and_its_outputs_are_numpys_on_the_dequantized_weights(tmp_path):
    rng = np.random.default_rng(7)
    weights = _layer(tmp_path / "m.onnx", rng)
    info = qwo.quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "q.onnx", 4, 32, algorithm="rtn_asym")
    assert info["matmul_groups_fused"] == 2 and info["matmuls_quantized"] == 6
    x = rng.normal(size=(3, K)).astype(np.float32)
    got = dict(zip([*WIDTHS, "o"], _run(tmp_path / "q.onnx", x), strict=True))
    deq = {name: im.quantize(w, 4, 32, "rtn_asym").dequantize() for name, w in weights.items()}
    r = np.maximum(x, 0).astype(np.float64)
    for name in WIDTHS:
        want = (x.astype(np.float64) if name in ("q", "k", "v") else r) @ deq[name]
        np.testing.assert_allclose(got[name], want, rtol=2e-2, atol=2e-2)  # float activations (accuracy level 0)


def test_nodes_that_differ_in_bits_or_input_stay_apart(tmp_path):
    rng = np.random.default_rng(8)
    _layer(tmp_path / "m.onnx", rng)
    qwo.quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "q.onnx", 4, 32, algorithm="rtn_asym")
    model = onnx.load(str(tmp_path / "q.onnx"))
    assert fuse_sibling_matmuls(model) == 0  # fused already: nothing left to fuse
    # a 4-bit and an 8-bit sibling of one input are two nodes
    with pytest.MonkeyPatch.context() as m:
        m.setattr(qwo, "fuse_sibling_matmuls", lambda model: 0)
        qwo.quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "a.onnx", 4, 32, algorithm="rtn_asym")
        qwo.quantize_matmul_nbits(tmp_path / "m.onnx", tmp_path / "b.onnx", 8, 32)
    a, b = onnx.load(str(tmp_path / "a.onnx")), onnx.load(str(tmp_path / "b.onnx"))
    q8 = next(n for n in b.graph.node if n.name.startswith("layers.0/k/"))
    k4 = next(i for i, n in enumerate(a.graph.node) if n.name.startswith("layers.0/k/"))
    a.graph.node.remove(a.graph.node[k4])
    a.graph.node.insert(k4, q8)
    a.graph.initializer.extend(t for t in b.graph.initializer if t.name in set(q8.input[1:]))
    assert fuse_sibling_matmuls(a) == 2  # q and v (4-bit) fuse, the 8-bit k stays; gate and up fuse
    assert any(n.op_type == "MatMulNBits" and n.name.startswith("layers.0/k/") for n in a.graph.node)
