"""What the graph builders share: the opset, a graph under construction and the model it becomes, and the
inputs and outputs of a KV-cache decoder.

Every graph is written at opset 17 and IR version 8 (what ONNX Runtime, OpenVINO and TensorRT all read).
A builder adds nodes and initializers to a ``GraphBuilder`` in order (the order is the graph's) and names
them its own way; ``GraphBuilder.model`` wraps them into the ``onnx.ModelProto``.

A KV-cache decoder (``decoder.py``, ``inplace_kv.py``) takes ``input_ids`` and ``attention_mask`` (and
``position_ids`` where the graph reads them), each layer's ``past_key_values.{i}.key/value`` and the
optional scalar ``logits_to_keep`` (default 0: every position; its default is an initializer), and
returns ``logits`` and each layer's ``present.{i}.key/value`` (``kv_decoder_io``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

OPSET = 17
IR_VERSION = 8
LOGITS_TO_KEEP = "logits_to_keep"


class GraphBuilder:
    """The nodes and initializers of one graph, in the order they were added."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.h, self.nh = helper, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def init(self, name: str, value: np.ndarray) -> str:
        """An initializer ``name`` holding ``value`` (a scalar becomes shape [1]); its name."""
        self.inits.append(self.nh.from_array(np.ascontiguousarray(value), name))
        return name

    def model(
        self, name: str, inputs: list[Any], outputs: list[Any], producer: str, domains: Sequence[tuple[str, int]] = ()
    ) -> Any:
        """The ``onnx.ModelProto`` of the graph ``name``: standard ops at ``OPSET``, plus each (domain, version)."""
        opsets = [self.h.make_opsetid("", OPSET), *(self.h.make_opsetid(d, v) for d, v in domains)]
        graph = self.h.make_graph(self.nodes, name, inputs, outputs, self.inits)
        return self.h.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name=producer)


def kv_decoder_io(
    layers: int, kv_heads: int, head_dim: int, vocab: int, position_ids: bool
) -> tuple[list[Any], list[Any]]:
    """A KV-cache decoder's graph inputs and outputs with their shapes (``logits_to_keep`` last among the
    inputs: give it its default with ``logits_to_keep_default``)."""
    from onnx import TensorProto, helper

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    past: list[str | int] = ["batch_size", kv_heads, "past_sequence_length", head_dim]
    present: list[str | int] = ["batch_size", kv_heads, "total_sequence_length", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_sequence_length"]),
    ]
    if position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, ["batch_size", "sequence_length"]))
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch_size", "logits_length", vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, past))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", f32, present))
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, i64, []))
    return inputs, outputs


def logits_to_keep_default() -> Any:
    """The initializer that gives ``logits_to_keep`` its default: 0, every position (an int64 scalar)."""
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(0, dtype=np.int64), LOGITS_TO_KEEP)
