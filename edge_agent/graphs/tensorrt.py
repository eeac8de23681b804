"""The ONNX graph a TensorRT build parses, and the checks its decoder profiles must pass.

An imported decoder (``graphs.decoder``, and the in-place KV graphs of ``graphs.inplace_kv``) takes
``logits_to_keep``, an optional int64 scalar whose default (0: every position) is an initializer listed
among the graph inputs. TensorRT's ONNX parser takes such an input for a constant, so the default would be built in:
logits for every position, ``[batch, seq, vocab]``, which for Gemma 3's 262,144-token head is 1 MB per
position (8.6 GB for 4 x 2,048). Making it a real input instead is no way out: its value sets the
logits' shape, which makes it a host shape tensor with value ranges per profile (int32 only on
TensorRT 10.3), and its largest value would size the output buffer as before.

So the graph TensorRT parses keeps the last position: the initializer is set to 1 and left out of the
inputs, the head multiplies one row per sequence, and the engine's ``logits`` are ``[batch, 1, vocab]``
in every profile. That is what serving reads (``DecoderLM`` takes the last position of every run).
What scores every position (the accuracy gate's held-out logits and perplexity) feeds such an engine
one token a call after a prefill (``backends.last_position_only``).

Decoder profiles: TensorRT builds each optimization profile at its min, opt and max shapes, where the
attention mask must span exactly the past plus the new tokens (the scores and the mask are added), so
``total_sequence_length = past_sequence_length + sequence_length`` at each of the three;
``decoder_profile_problems`` says where a recipe breaks that before TensorRT fails deep in a build.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .builder import LOGITS_TO_KEEP as KEEP

_LEVELS = ("min", "opt", "max")

Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def last_position_graph(src: Path) -> tuple[bytes | None, dict]:
    """The serialized graph TensorRT should parse instead of ``src`` (None: ``src`` as it is), and what was
    changed, for the build report. A decoder with ``logits_to_keep`` keeps the last position's logits (see
    the module doc); its external weights are not copied: the parser finds them beside ``src``
    (``OnnxParser.parse(model, path)``)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    default = next((t for t in graph.initializer if t.name == KEEP), None)
    if default is None or KEEP not in {v.name for v in graph.input}:
        return None, {}
    default.CopyFrom(numpy_helper.from_array(np.array(1, dtype=np.int64), KEEP))
    inputs = [v for v in graph.input if v.name != KEEP]
    del graph.input[:]
    graph.input.extend(inputs)
    for out in graph.output:
        dims = out.type.tensor_type.shape.dim
        if out.name == "logits" and len(dims) == 3:
            dims[1].Clear()
            dims[1].dim_value = 1
    return model.SerializeToString(), {"logits": "last position per sequence (logits_to_keep = 1 built in)"}


def decoder_profile_problems(profiles: Sequence[tuple[str, Shapes]], max_context: int | None = None) -> list[str]:
    """Where the profiles of a KV-cache decoder break ``total = past + new`` at their min, opt or max shapes,
    or reach past the model's context; empty for graphs that are not such decoders."""
    problems = []
    for name, shapes in profiles:
        ids, mask, past = shapes.get("input_ids"), shapes.get("attention_mask"), shapes.get("past_key_values.0.key")
        if ids is None or mask is None or past is None:
            continue
        for level, s, t, p in zip(_LEVELS, ids, mask, past):
            if len(s) == 2 and len(t) == 2 and len(p) == 4 and p[2] + s[1] != t[1]:
                problems.append(
                    f"profile {name!r} at its {level} shapes: the attention mask spans {t[1]} tokens but past + new "
                    f"= {p[2]} + {s[1]} (total_sequence_length must be past_sequence_length + sequence_length)"
                )
        if max_context and len(mask[2]) == 2 and mask[2][1] > max_context:
            problems.append(
                f"profile {name!r} reaches {mask[2][1]} tokens, past the model's context of {max_context} "
                "(max_position_embeddings)"
            )
    return problems
