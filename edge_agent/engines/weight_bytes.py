"""Bytes of weights a decoder reads per generated token, counted from the engine's own graph.

One decode step multiplies one token's activations by every weight matrix once, so the bytes it
must stream from memory are the sizes of the weight tensors as stored: float32, float16, the packed
4/8-bit blocks of ``MatMulNBits`` plus their scales and zero points, NNCF's compressed constants.
Embedding tables are the exception: a ``Gather`` reads one row per token, so tables that only feed
a ``Gather`` are left out (the LM head, a MatMul, is counted even when tied to the table). So are
rotary cos/sin caches fed to ``GroupQueryAttention`` or ``RotaryEmbedding`` (one row per position: a
Gemma 3 in-place graph holds 67 MB of them). Small constants (shapes, axes) are counted; they are noise.
KV-cache reads grow with the context and are not weights: not counted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_ONNX_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2}  # TensorProto.DataType -> bytes
# OpenVINO ops between a compressed constant and its consumer (the decompression subgraph).
_OV_PASS_THROUGH = {"Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze"}


def _onnx_tensor_bytes(tensor) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.raw_data:
        return len(tensor.raw_data)
    count = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
    per = _ONNX_BYTES.get(tensor.data_type)
    if tensor.data_type in (21, 22):  # uint4 / int4: two per byte
        return (count + 1) // 2
    return count * (per or 4)


# (op, input index) that read one row of a table per token or position: embedding gathers, rotary caches
_ROW_READS = {
    ("Gather", 0),
    ("GatherBlockQuantized", 0),
    ("GatherBlockQuantized", 2),  # its scales
    ("GatherBlockQuantized", 3),  # its zero points
    ("GroupQueryAttention", 7),  # cos_cache
    ("GroupQueryAttention", 8),  # sin_cache
    ("RotaryEmbedding", 2),
    ("RotaryEmbedding", 3),
}


def onnx_weight_bytes(graph_path: Path) -> int:
    """Initializer bytes of an ONNX graph, less the tables read a row at a time (``_ROW_READS``)."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    consumers: dict[str, set[tuple[str, int]]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, set()).add((node.op_type, index))
    total = 0
    for init in model.graph.initializer:
        uses = consumers.get(init.name, set())
        if uses and uses <= _ROW_READS:
            continue
        total += _onnx_tensor_bytes(init)
    return total


def _feeds_only_gather(node) -> bool:
    """True when every path from an OpenVINO constant, through decompression ops, ends in a Gather's data input."""
    seen = 0
    stack = [node]
    while stack:
        current = stack.pop()
        for output in current.outputs():
            for target in output.get_target_inputs():
                op = target.get_node()
                kind = op.get_type_name()
                if kind in _OV_PASS_THROUGH:
                    stack.append(op)
                elif kind == "Gather" and target.get_index() == 0:
                    seen += 1
                else:
                    return False
    return seen > 0


def openvino_weight_bytes(xml_path: Path) -> int:
    """Constant bytes of an OpenVINO IR, less the tables read only through ``Gather``."""
    import openvino as ov

    model = ov.Core().read_model(str(xml_path))
    total = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant" or _feeds_only_gather(op):
            continue
        total += int(op.get_byte_size())
    return total


def weight_bytes(graph_path: Path) -> int | None:
    """Per-token weight bytes of an ONNX graph or an OpenVINO IR; None for other artifacts (TensorRT plans)."""
    path = Path(graph_path)
    if path.suffix == ".onnx":
        return onnx_weight_bytes(path)
    if path.suffix == ".xml":
        return openvino_weight_bytes(path)
    return None
