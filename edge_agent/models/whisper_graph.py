"""Whisper's encoder and decoders as ONNX graphs, built with the ``onnx`` helper API from float32 weights.

The three graphs are the Whisper folder contract the agent serves (``models/asr_whisper.py``, the
demo-whisper section of ``demo_models/README.md``):

    encoder_model.onnx           input_features [B, mels, F] -> last_hidden_state [B, F/2, d]   (F = 3000: 30 s)
    decoder_model.onnx           input_ids [B, S], encoder_hidden_states [B, T, d]
                                 -> logits [B, S, V], present.{i}.decoder|encoder.key|value [B, H, S|T, d/H]
    decoder_with_past_model.onnx input_ids [B, S], past_key_values.{i}.decoder|encoder.key|value
                                 -> logits, present.{i}.decoder.key|value [B, H, past + S, d/H]

The computation is OpenAI's Whisper (and CTranslate2's WhisperSpec): conv1 (k3, pad 1) -> GELU ->
conv2 (k3, stride 2, pad 1) -> GELU -> + sinusoidal positions -> pre-norm encoder layers -> LayerNorm;
the decoder embeds tokens, adds learned positions from the past length, runs pre-norm layers of causal
self-attention, cross-attention and a GELU MLP, a final LayerNorm, and the tied output projection.
GELU is the exact (erf) one; LayerNorm epsilon 1e-5. The attention scale d_head^-0.5 is folded into
the query weights and bias (the same product, one multiply fewer per step).

Only standard ONNX ops at opset 17 (LayerNormalization, Erf, Conv, MatMul, Softmax …), so ONNX Runtime
and OpenVINO both load the graphs. The encoder's time axis is dynamic: 3000 frames (30 s, how Whisper is
trained and how every final is recognised) take the whole sinusoidal table; a shorter input takes its
first F/2 positions (whisper.cpp's ``audio_ctx``), which the recogniser uses for cheap partials. The NPU
reshapes it to 3000 frames before compiling (static shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

OPSET = 17
LN_EPS = 1e-5
_NEG = -1e9  # masked attention score: large but finite, so a float16 conversion does not make NaN

Weights = Callable[[str], np.ndarray]  # ct2 variable name -> float32 array


@dataclass(frozen=True, slots=True)
class WhisperDims:
    """The sizes of one Whisper: layers, heads, width, mel bins, vocabulary, positions."""

    n_mels: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    decoder_layers: int
    decoder_heads: int
    ffn: int
    vocab: int
    source_positions: int  # 1500 encoder frames (30 s)
    target_positions: int  # 448 decoder positions

    @property
    def frames(self) -> int:
        return self.source_positions * 2  # conv2 halves the 3000 mel frames


class _Graph:
    """Nodes and initializers with unique names."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.h, self.nh = helper, numpy_helper
        self.nodes: list = []
        self.inits: list = []
        self._n = 0

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(self.nh.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op: str, inputs: list[str], outputs: int = 1, **attrs) -> list[str]:
        self._n += 1
        name = f"{op}_{self._n}"
        outs = [f"{name}/out{i}" for i in range(outputs)]
        self.nodes.append(self.h.make_node(op, inputs, outs, name=name, **attrs))
        return outs

    def one(self, op: str, inputs: list[str], **attrs) -> str:
        return self.op(op, inputs, **attrs)[0]

    # -- layers ------------------------------------------------------------------------------

    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None, name: str) -> str:
        y = self.one("MatMul", [x, self.init(f"{name}.weight_t", w.T.astype(np.float32))])
        return y if b is None else self.one("Add", [y, self.init(f"{name}.bias", b.astype(np.float32))])

    def layer_norm(self, x: str, get: Weights, prefix: str) -> str:
        return self.one(
            "LayerNormalization",
            [
                x,
                self.init(f"{prefix}.gamma", get(f"{prefix}/gamma")),
                self.init(f"{prefix}.beta", get(f"{prefix}/beta")),
            ],
            axis=-1,
            epsilon=LN_EPS,
        )

    def gelu(self, x: str) -> str:
        c = self.init(f"gelu_c{self._n}", np.array(1 / np.sqrt(2), np.float32))
        half = self.init(f"gelu_h{self._n}", np.array(0.5, np.float32))
        one = self.init(f"gelu_o{self._n}", np.array(1.0, np.float32))
        e = self.one("Erf", [self.one("Mul", [x, c])])
        return self.one("Mul", [self.one("Mul", [x, half]), self.one("Add", [e, one])])

    def heads(self, x: str, n_heads: int, d_head: int) -> str:
        """[B, T, H*D] -> [B, H, T, D]"""
        shape = self.init(f"heads_shape{self._n}", np.array([0, 0, n_heads, d_head], np.int64))
        return self.one("Transpose", [self.one("Reshape", [x, shape])], perm=[0, 2, 1, 3])

    def merge(self, x: str, d_model: int) -> str:
        """[B, H, T, D] -> [B, T, H*D]"""
        shape = self.init(f"merge_shape{self._n}", np.array([0, 0, d_model], np.int64))
        return self.one("Reshape", [self.one("Transpose", [x], perm=[0, 2, 1, 3]), shape])

    def attend(self, q: str, k: str, v: str, mask: str | None) -> str:
        scores = self.one("MatMul", [q, self.one("Transpose", [k], perm=[0, 1, 3, 2])])
        if mask is not None:
            scores = self.one("Add", [scores, mask])
        return self.one("MatMul", [self.one("Softmax", [scores], axis=-1), v])

    def mlp(self, x: str, get: Weights, prefix: str) -> str:
        h = self.layer_norm(x, get, f"{prefix}/layer_norm")
        h = self.linear(h, get(f"{prefix}/linear_0/weight"), get(f"{prefix}/linear_0/bias"), f"{prefix}/linear_0")
        h = self.gelu(h)
        return self.linear(h, get(f"{prefix}/linear_1/weight"), get(f"{prefix}/linear_1/bias"), f"{prefix}/linear_1")


def _scaled_qkv(w: np.ndarray, b: np.ndarray, d_model: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The fused [3d, d] q/k/v projection with the attention scale folded into the q rows."""
    w, b = w.copy(), b.copy()
    w[:d_model] *= scale
    b[:d_model] *= scale
    return w, b


def _value(name: str, shape: list, elem: int = 1):
    from onnx import helper

    return helper.make_tensor_value_info(name, elem, shape)


def _model(g: _Graph, name: str, inputs: list, outputs: list):
    from onnx import helper

    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8, producer_name="edge-agent ct2-whisper"
    )


def build_encoder(dims: WhisperDims, get: Weights):
    """``encoder_model.onnx`` as an ``onnx.ModelProto``."""
    g = _Graph()
    d, h = dims.d_model, dims.encoder_heads
    x = g.one(
        "Conv",
        [
            "input_features",
            g.init("conv1.weight", get("encoder/conv1/weight")),
            g.init("conv1.bias", get("encoder/conv1/bias")),
        ],
        pads=[1, 1],
        kernel_shape=[3],
    )
    x = g.gelu(x)
    x = g.one(
        "Conv",
        [x, g.init("conv2.weight", get("encoder/conv2/weight")), g.init("conv2.bias", get("encoder/conv2/bias"))],
        pads=[1, 1],
        strides=[2],
        kernel_shape=[3],
    )
    x = g.gelu(x)
    x = g.one("Transpose", [x], perm=[0, 2, 1])  # [B, T, d]: T = frames / 2, 1500 for 30 s
    # The first T positions (whisper.cpp's audio_ctx): 3000 frames give the full table, a shorter input
    # (a partial of a few seconds) the positions its frames had at the start of a 30 s window.
    zero = g.init("enc_zero", np.array([0], np.int64))
    length = g.one(
        "Slice",
        [
            g.one("Shape", [x]),
            g.init("enc_one", np.array([1], np.int64)),
            g.init("enc_two", np.array([2], np.int64)),
            zero,
        ],
    )
    positions = g.init("positions", get("encoder/position_encodings/encodings")[: dims.source_positions])
    x = g.one("Add", [x, g.one("Slice", [positions, zero, length, zero])])
    scale = (d // h) ** -0.5
    for i in range(dims.encoder_layers):
        p = f"encoder/layer_{i}"
        a = g.layer_norm(x, get, f"{p}/self_attention/layer_norm")
        w, b = _scaled_qkv(
            get(f"{p}/self_attention/linear_0/weight"), get(f"{p}/self_attention/linear_0/bias"), d, scale
        )
        qkv = g.linear(a, w, b, f"{p}/self_attention/qkv")
        q, k, v = g.op("Split", [qkv, g.init(f"{p}.split", np.array([d, d, d], np.int64))], outputs=3, axis=-1)
        o = g.attend(g.heads(q, h, d // h), g.heads(k, h, d // h), g.heads(v, h, d // h), None)
        o = g.linear(
            g.merge(o, d),
            get(f"{p}/self_attention/linear_1/weight"),
            get(f"{p}/self_attention/linear_1/bias"),
            f"{p}/self_attention/out",
        )
        x = g.one("Add", [x, o])
        x = g.one("Add", [x, g.mlp(x, get, f"{p}/ffn")])
    out = g.layer_norm(x, get, "encoder/layer_norm")
    g.nodes.append(g.h.make_node("Identity", [out], ["last_hidden_state"], name="output"))
    return _model(
        g,
        "whisper_encoder",
        [_value("input_features", ["batch_size", dims.n_mels, "encoder_frames"])],
        [_value("last_hidden_state", ["batch_size", "encoder_sequence_length", d])],
    )


def build_decoder(dims: WhisperDims, get: Weights, with_past: bool):
    """``decoder_model.onnx`` (``with_past=False``) or ``decoder_with_past_model.onnx``."""
    g = _Graph()
    d, h = dims.d_model, dims.decoder_heads
    dh = d // h
    scale = dh**-0.5
    embed = get("decoder/embeddings/weight")
    zero = g.init("zero", np.array([0], np.int64))
    one = g.init("one", np.array([1], np.int64))
    two = g.init("two", np.array([2], np.int64))
    ids_shape = g.one("Shape", ["input_ids"])
    new_len = g.one("Slice", [ids_shape, one, two, zero])  # [S]
    if with_past:
        past_len = g.one(
            "Slice",
            [g.one("Shape", ["past_key_values.0.decoder.key"]), two, g.init("three", np.array([3], np.int64)), zero],
        )
    else:
        past_len = zero
    total = g.one("Add", [past_len, new_len])
    x = g.one("Gather", [g.init("embed_tokens", embed), "input_ids"], axis=0)
    positions = g.init("embed_positions", get("decoder/position_encodings/encodings")[: dims.target_positions])
    x = g.one("Add", [x, g.one("Slice", [positions, past_len, total, zero])])
    causal = np.triu(np.full((dims.target_positions, dims.target_positions), _NEG, np.float32), k=1)
    mask = g.one(
        "Slice",
        [
            g.init("causal_mask", causal),
            g.one("Concat", [past_len, zero], axis=0),
            g.one("Concat", [total, total], axis=0),
            g.init("axes01", np.array([0, 1], np.int64)),
        ],
    )
    inputs = [_value("input_ids", ["batch_size", "decoder_sequence_length"], 7)]
    if not with_past:
        inputs.append(_value("encoder_hidden_states", ["batch_size", "encoder_sequence_length", d]))
    outputs: list = []
    for i in range(dims.decoder_layers):
        p = f"decoder/layer_{i}"
        a = g.layer_norm(x, get, f"{p}/self_attention/layer_norm")
        w, b = _scaled_qkv(
            get(f"{p}/self_attention/linear_0/weight"), get(f"{p}/self_attention/linear_0/bias"), d, scale
        )
        qkv = g.linear(a, w, b, f"{p}/self_attention/qkv")
        q, k, v = g.op("Split", [qkv, g.init(f"{p}.split", np.array([d, d, d], np.int64))], outputs=3, axis=-1)
        k, v = g.heads(k, h, dh), g.heads(v, h, dh)
        if with_past:
            for kind in ("key", "value"):
                inputs.append(
                    _value(f"past_key_values.{i}.decoder.{kind}", ["batch_size", h, "past_decoder_sequence_length", dh])
                )
            k = g.one("Concat", [f"past_key_values.{i}.decoder.key", k], axis=2)
            v = g.one("Concat", [f"past_key_values.{i}.decoder.value", v], axis=2)
        present_shape = [
            "batch_size",
            h,
            "total_decoder_sequence_length" if with_past else "decoder_sequence_length",
            dh,
        ]
        for kind, t in (("key", k), ("value", v)):
            g.nodes.append(g.h.make_node("Identity", [t], [f"present.{i}.decoder.{kind}"], name=f"present_{i}_d{kind}"))
            outputs.append(_value(f"present.{i}.decoder.{kind}", present_shape))
        o = g.attend(g.heads(q, h, dh), k, v, mask)
        o = g.linear(
            g.merge(o, d),
            get(f"{p}/self_attention/linear_1/weight"),
            get(f"{p}/self_attention/linear_1/bias"),
            f"{p}/self_attention/out",
        )
        x = g.one("Add", [x, o])

        # cross-attention: keys and values from the encoder, computed once in the first step
        c = g.layer_norm(x, get, f"{p}/attention/layer_norm")
        wq, bq = get(f"{p}/attention/linear_0/weight") * scale, get(f"{p}/attention/linear_0/bias") * scale
        q = g.heads(g.linear(c, wq, bq, f"{p}/attention/q"), h, dh)
        if with_past:
            for kind in ("key", "value"):
                inputs.append(
                    _value(f"past_key_values.{i}.encoder.{kind}", ["batch_size", h, "encoder_sequence_length", dh])
                )
            ek, ev = f"past_key_values.{i}.encoder.key", f"past_key_values.{i}.encoder.value"
        else:
            kv = g.linear(
                "encoder_hidden_states",
                get(f"{p}/attention/linear_1/weight"),
                get(f"{p}/attention/linear_1/bias"),
                f"{p}/attention/kv",
            )
            ek, ev = g.op("Split", [kv, g.init(f"{p}.kvsplit", np.array([d, d], np.int64))], outputs=2, axis=-1)
            ek, ev = g.heads(ek, h, dh), g.heads(ev, h, dh)
            for kind, t in (("key", ek), ("value", ev)):
                g.nodes.append(
                    g.h.make_node("Identity", [t], [f"present.{i}.encoder.{kind}"], name=f"present_{i}_e{kind}")
                )
                outputs.append(_value(f"present.{i}.encoder.{kind}", ["batch_size", h, "encoder_sequence_length", dh]))
        o = g.attend(q, ek, ev, None)
        o = g.linear(
            g.merge(o, d),
            get(f"{p}/attention/linear_2/weight"),
            get(f"{p}/attention/linear_2/bias"),
            f"{p}/attention/out",
        )
        x = g.one("Add", [x, o])
        x = g.one("Add", [x, g.mlp(x, get, f"{p}/ffn")])
    x = g.layer_norm(x, get, "decoder/layer_norm")
    # tied output projection: Gemm with transB reads the embedding table itself (one copy in the file)
    flat = g.one("Reshape", [x, g.init("flat_shape", np.array([-1, d], np.int64))])
    logits = g.one("Gemm", [flat, "embed_tokens"], transB=1)
    shape = g.one("Concat", [ids_shape, g.init("minus_one", np.array([-1], np.int64))], axis=0)
    g.nodes.append(g.h.make_node("Reshape", [logits, shape], ["logits"], name="logits"))
    return _model(
        g,
        "whisper_decoder_with_past" if with_past else "whisper_decoder",
        inputs,
        [_value("logits", ["batch_size", "decoder_sequence_length", dims.vocab]), *outputs],
    )
