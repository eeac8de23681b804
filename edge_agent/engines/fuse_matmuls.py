"""One MatMulNBits for the weight-only matmuls that read the same activations.

A transformer layer multiplies one normalised hidden state by several weights: the query, key and value
projections, the feed-forward's gate and up projections. Quantized each on its own, a decode step runs
them as separate ``com.microsoft.MatMulNBits`` calls, each a pass of the thread pool over a few thousand
columns; at batch 1 on a CPU that overhead is a large part of a small matmul's time. MatMulNBits computes
every output column from its own block codes, scales and zero points, so the siblings' weights stacked
along N make one node whose output, split along its last axis, is exactly theirs (bit for bit: the
activations are quantized once per row either way). ``fuse_sibling_matmuls`` does that in place for
every group of MatMulNBits nodes with the same input and the same K, bits, block size, accuracy level and
inputs (zero points or not).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

_STACKED = (1, 2, 3)  # B, scales, zero points: one row (or run of rows) per output column, stacked along N


def fuse_sibling_matmuls(model: Any) -> int:
    """Fuse the MatMulNBits siblings of ``model`` (an ``onnx.ModelProto``, changed in place); returns how many
    groups became one node. Nodes with a bias or group index input are left alone."""
    from onnx import helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups: dict[tuple, list[Any]] = defaultdict(list)
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) > 4:
            continue
        if not all(name in inits for name in node.input[1:] if name):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        settings = tuple(sorted((k, v) for k, v in attrs.items() if k != "N"))  # K, bits, block size, level
        groups[(node.input[0], settings, tuple(bool(name) for name in node.input[1:]))].append(node)
    fused = 0
    for siblings in groups.values():
        if len(siblings) < 2:
            continue
        _fuse(graph, inits, siblings)
        fused += 1
    if fused:
        used = {name for node in graph.node for name in node.input}
        for t in [t for t in graph.initializer if t.name not in used]:
            graph.initializer.remove(t)
    return fused


def _fuse(graph: Any, inits: dict[str, Any], siblings: list[Any]) -> None:
    """``siblings`` (same input and settings) as one MatMulNBits over their weights stacked along N, and a
    Split along the last axis whose outputs are theirs, where the first of them was."""
    from onnx import helper, numpy_helper

    first = siblings[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in first.attribute}
    widths = [next(a.i for a in n.attribute if a.name == "N") for n in siblings]
    name = first.name + "_fused"
    inputs = [first.input[0]]
    for k in _STACKED[: len(first.input) - 1]:
        if not first.input[k]:
            inputs.append("")
            continue
        parts = [numpy_helper.to_array(inits[n.input[k]]) for n in siblings]
        # scales and zero points may be stored flat ([N * blocks]): stacked per column all the same
        rows = [p.reshape(w, -1) for p, w in zip(parts, widths)]
        stacked = np.concatenate(rows, axis=0)
        if parts[0].ndim == 1:
            stacked = stacked.reshape(-1)
        elif parts[0].ndim == 3:
            stacked = stacked.reshape(sum(widths), *parts[0].shape[1:])
        tensor = numpy_helper.from_array(stacked, f"{name}.input{k}")
        graph.initializer.append(tensor)
        inits[tensor.name] = tensor
        inputs.append(tensor.name)
    sizes = numpy_helper.from_array(np.array(widths, np.int64), f"{name}.split")
    graph.initializer.append(sizes)
    matmul = helper.make_node(
        "MatMulNBits", inputs, [f"{name}/output_0"], name=name, domain="com.microsoft", **(attrs | {"N": sum(widths)})
    )
    split = helper.make_node(
        "Split", [matmul.output[0], sizes.name], [n.output[0] for n in siblings], name=f"{name}/Split", axis=-1
    )
    nodes = list(graph.node)
    at = min(nodes.index(n) for n in siblings)
    for n in siblings:
        graph.node.remove(n)
    graph.node.insert(at, split)
    graph.node.insert(at, matmul)
