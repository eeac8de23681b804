"""A decoder export made into the stateful form the NPU plugin's LLM mode compiles.

The plain export (``past_key_values.N.key/value`` in, ``present.N.key/value`` out) becomes optimum-intel's
stateful form: a ``beam_idx`` input [batch] i32 gathers every past tensor along the batch axis, and
OpenVINO's MakeStateful pass turns each past/present pair into a variable kept in the infer request.
The plugin refuses stateful models without ``beam_idx``.

Three things in an export are wrong under the NPU's fixed-size KV cache and are rewritten here:

- **Positions from shapes.** Some exports take no ``position_ids`` (optimum's Gemma family): the rotary
  embedding reads ``arange(past, past + seq)`` off the past's shape, a constant under the plugin's fixed
  cache. A ``position_ids`` input is added and fed to the rotary embedding (the branches of that range
  that reach a Cos/Sin before any comparison); the mask keeps its own arithmetic, which is right.

- **Sliding windows from shapes.** Gemma-2 style exports compute the window test ``kv > q - window`` from
  the past length read off tensor shapes. The plugin keeps the cache at a fixed size, so that length is a
  constant, and decode steps mask out the tokens they should see (first token right, the rest wrong). The
  test is rewritten on positions: a key's position is its index among the attention mask's ones, a
  query's is its ``position_ids`` entry. Both agree with the shape arithmetic wherever that was right.
- **A float32-minimum mask.** Rows the plugin pads attend to nothing; through f16 (the NPU's numerics) the
  float32 minimum becomes -inf and softmax gives NaN, which reaches every logit. The mask's fill value is
  clamped to f16's lowest finite value, which changes nothing in f32 (exp underflows to 0 either way).
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from ..errors import ModelError

log = logging.getLogger(__name__)

_F16_LOWEST = float(np.finfo(np.float16).min)


def is_stateful(model: ov.Model) -> bool:
    return bool(model.get_sinks()) and any("beam_idx" in p.get_names() for p in model.inputs)


def make_stateful(model: ov.Model, sliding_window: int | None = None, capacity: int | None = None) -> dict[str, int]:
    """Turn the plain decoder export ``model`` into the stateful form, in place; what was rewritten.
    ``capacity``: the tokens the NPU's cache will hold; a sliding window narrower than that must be
    found and rewritten, or the conversion is refused (its tokens would be wrong from the second on)."""
    past = [p for p in model.inputs if p.get_any_name().startswith("past_key_values.")]
    if not past:
        raise ModelError("not a decoder export with a KV cache: no past_key_values.N inputs to keep as state")
    names = {p.get_any_name() for p in model.inputs}
    positions_added = 0
    if "attention_mask" in names and "position_ids" not in names:
        positions_added = _add_position_ids(model)
        names = {p.get_any_name() for p in model.inputs}
    if "attention_mask" not in names or "position_ids" not in names:
        raise ModelError(
            "the NPU's LLM mode needs input_ids, attention_mask and position_ids inputs; this export has "
            f"{sorted(n for n in names if not n.startswith('past_key_values.'))}, and its positions could not "
            "be traced to a rotary embedding to feed them"
        )
    windows = _rewrite_sliding_window(model, sliding_window) if sliding_window else 0
    on_positions = bool(sliding_window and not windows and _window_on_positions(model, sliding_window))
    if sliding_window and not windows and not on_positions and (capacity is None or sliding_window < capacity):
        raise ModelError(
            f"the export's sliding window of {sliding_window} tokens is narrower than the NPU's cache"
            + (f" of {capacity} tokens" if capacity else "")
            + ", and its window test (kv > q - window) was not found to compute it from positions; under the "
            "NPU's fixed-size cache it would mask the wrong tokens: serve this export on the CPU"
        )
    clamped = _clamp_mask_minimum(model)
    beam = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    for port in past:
        consumers = list(port.get_target_inputs())
        gathered = ops.gather(port, beam, ops.constant(np.int64(0)))
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    model.add_parameters([beam])
    from openvino._offline_transformations import apply_make_stateful_transformation  # type: ignore[import-untyped]  # no stubs

    pairs = {p.get_any_name(): p.get_any_name().replace("past_key_values.", "present.", 1) for p in past}
    outputs = {n for o in model.outputs for n in o.get_names()}
    missing = sorted(v for v in pairs.values() if v not in outputs)
    if missing:
        raise ModelError(f"the export has past inputs without their present outputs: {missing[:4]}")
    apply_make_stateful_transformation(model, pairs)
    model.validate_nodes_and_infer_types()
    return {
        "kv_states": len(pairs),
        "sliding_window_rewrites": windows,
        "mask_minimum_clamped": clamped,
        "position_ids_added": positions_added,
    }


_COMPARISONS = {"Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual"}


def _add_position_ids(model: ov.Model) -> int:
    """Add a ``position_ids`` input [B, S] and feed it where the export's rotary embedding took
    ``arange(past, past + seq)`` from the past's shape; the number of inputs rewired (0: none found, and
    then no input is added)."""
    positions = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
    positions.output(0).get_tensor().set_names({"position_ids"})
    rewired = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Range" or not _from_past_shape(node.input_value(0).get_node()):
            continue
        for target in list(node.output(0).get_target_inputs()):
            user = target.get_node()
            if user.get_type_name() == "Unsqueeze" and _constant_value(user.input_value(1).get_node()) == 0:
                # arange(...)[None]: [1, S], the shape of position_ids for the one sequence the NPU runs
                for inner in list(user.output(0).get_target_inputs()):
                    if _reaches_rotary(inner.get_node()):
                        kind = user.get_output_element_type(0)
                        inner.replace_source_output(ops.convert(positions, kind).output(0))
                        rewired += 1
            elif _reaches_rotary(user):
                kind = node.get_output_element_type(0)
                flat = ops.squeeze(positions, ops.constant(np.array([0], dtype=np.int64)))
                target.replace_source_output(ops.convert(flat, kind).output(0))
                rewired += 1
    if rewired:
        model.add_parameters([positions])
        model.validate_nodes_and_infer_types()
    return rewired


def _from_past_shape(node, depth: int = 8) -> bool:
    """Whether ``node``'s value comes from the shape of a past_key_values input."""
    # Breadth first: a node is first reached at its least depth, so the depth bound never hides a path
    # that a deeper first visit (and its "seen" mark) would (graph sets have no stable order).
    queue, seen = deque([(node, 0)]), set()
    while queue:
        current, level = queue.popleft()
        if id(current) in seen or level > depth:
            continue
        seen.add(id(current))
        if current.get_type_name() in ("ShapeOf", "Shape"):
            source = current.input_value(0).get_node()
            if source.get_type_name() == "Parameter" and source.get_friendly_name().startswith("past_key_values"):
                return True
            if any(n.startswith("past_key_values") for n in current.input_value(0).get_names()):
                return True
        queue.extend((current.input_value(i).get_node(), level + 1) for i in range(current.get_input_size()))
    return False


def _reaches_rotary(node, depth: int = 12) -> bool:
    """Whether ``node`` leads to a Cos or Sin before any comparison (a rotary embedding, not a mask);
    breadth first, as ``_from_past_shape``."""
    frontier, seen = deque([(node, 0)]), set()
    while frontier:
        current, level = frontier.popleft()
        kind = current.get_type_name()
        if id(current) in seen or level > depth or kind in _COMPARISONS:
            continue
        seen.add(id(current))
        if kind in ("Cos", "Sin"):
            return True
        for out in current.outputs():
            frontier.extend((t.get_node(), level + 1) for t in out.get_target_inputs())
    return False


def _constant_value(node) -> float | None:
    if node.get_type_name() != "Constant":
        return None
    data = node.get_data()
    return float(data.reshape(-1)[0]) if data.size == 1 or np.all(data == data.reshape(-1)[0]) else None


def _rewrite_sliding_window(model: ov.Model, window: int) -> int:
    """Rewrite every ``Greater(kv_index, Subtract(q_index, window))`` on positions (see the module doc)."""
    mask = model.input("attention_mask")
    positions = model.input("position_ids")
    kv_pos = None
    rewritten = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Greater":
            continue
        right = node.input_value(1).get_node()
        if right.get_type_name() != "Subtract" or _constant_value(right.input_value(1).get_node()) != window:
            continue
        if kv_pos is None:
            # a key's position: the number of ones before it in the mask ([B, K] -> [B, 1, 1, K])
            ones = ops.convert(mask, ov.Type.i64)
            counted = ops.subtract(ops.cumsum(ones, ops.constant(np.int64(1))), ops.constant(np.int64(1)))
            kv_pos = ops.unsqueeze(counted, ops.constant(np.array([1, 2], dtype=np.int64)))
            q_pos = ops.unsqueeze(ops.convert(positions, ov.Type.i64), ops.constant(np.array([1, 3], dtype=np.int64)))
            q_low = ops.subtract(q_pos, ops.constant(np.int64(window)))
        left_type = node.input_value(0).get_element_type()
        node.input(0).replace_source_output(ops.convert(kv_pos, left_type).output(0))
        node.input(1).replace_source_output(ops.convert(q_low, left_type).output(0))
        rewritten += 1
    return rewritten


def _window_on_positions(model: ov.Model, window: int) -> bool:
    """Whether the export already tests its window on positions (edge-agent's imported decoders): key
    positions counted from the attention mask (a ``CumSum`` of it) and a comparison with the window."""
    counts_mask = compares_window = False
    for node in model.get_ordered_ops():
        kind = node.get_type_name()
        if kind == "CumSum":
            source = node.input_value(0).get_node()
            while source.get_type_name() in ("Convert", "Unsqueeze", "Reshape") and source.get_input_size():
                source = source.input_value(0).get_node()
            counts_mask = counts_mask or "attention_mask" in source.output(0).get_names()
        elif kind in _COMPARISONS and node.get_input_size() == 2:
            compares_window = compares_window or _constant_value(node.input_value(1).get_node()) == window
    return counts_mask and compares_window


def _clamp_mask_minimum(model: ov.Model) -> int:
    """Replace float32-minimum constants (the mask's fill) with f16's lowest finite value."""
    lowest = float(np.finfo(np.float32).min)
    clamped = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant" or node.get_output_element_type(0) != ov.Type.f32:
            continue
        data = node.get_data()
        if data.size == 0 or data.size > 1 << 16 or not np.any(data <= lowest * 0.5):
            continue
        fixed = np.where(data <= lowest * 0.5, np.float32(_F16_LOWEST), data).astype(np.float32)
        replacement = ops.constant(fixed)
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(replacement.output(0))
        clamped += 1
    return clamped
