"""Whisper's encoder and decoders as ONNX graphs, built with the ``onnx`` helper API from float32 weights.

The three graphs are the Whisper folder contract the agent serves (``models/asr_whisper.py``, the
demo-whisper section of ``demo_models/README.md``):

    encoder_model.onnx           input_features [B, mels, F] -> last_hidden_state [B, F/2, d]   (F = 3000: 30 s)
    decoder_model.onnx           input_ids [B, S], encoder_hidden_states [B, T, d]
                                 -> logits [B, S, V], present.{i}.decoder|encoder.key|value [B, H, S|T, d/H]
    decoder_with_past_model.onnx input_ids [B, S], past_key_values.{i}.decoder|encoder.key|value
                                 -> logits, present.{i}.decoder.key|value [B, H, past + S, d/H]

Both decoders take an optional int64 scalar ``logits_to_keep`` (default 0: logits of every position; k > 0:
of the last k only, S' = k).

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .builder import LOGITS_TO_KEEP, GraphBuilder, logits_to_keep_default

PRODUCER = "edge-agent ct2-whisper"
LN_EPS = 1e-5
MASKED_SCORE = -1e9  # a masked attention score: large but finite, so a float16 conversion does not make NaN

Weights = Callable[[str], np.ndarray]  # ct2 variable name -> float32 array
Param = np.ndarray | Callable[[], np.ndarray]  # a weight, or how to make it from the ct2 weights
Stored = Mapping[str, np.ndarray]  # the initializers of graphs built before, by name


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


class _Graph(GraphBuilder):
    """Nodes and initializers with unique names.

    A weight (``param``) is given as a value or a function that makes it from the CTranslate2 weights.
    With ``stored`` (the initializers of graphs built before, by name) it is taken from there instead and
    the function is never called: how the NPU's graphs are built from an imported folder, whose
    ``model.bin`` is gone, with the very tensors its other graphs compute with."""

    def __init__(self, stored: Mapping[str, np.ndarray] | None = None) -> None:
        super().__init__()
        self.stored = stored
        self._params: set[str] = set()
        self._n = 0

    def param(self, name: str, value: Param) -> str:
        """A weight named ``name``: ``value`` (called when a function), or the stored tensor of that name."""
        if name in self._params:  # the tied embedding table, read by two nodes
            return name
        self._params.add(name)
        if self.stored is not None:
            if name not in self.stored:
                raise KeyError(name)
            return self.init(name, self.stored[name])
        return self.init(name, value() if callable(value) else value)

    def op(self, op: str, inputs: list[str], outputs: int = 1, **attrs) -> list[str]:
        self._n += 1
        name = f"{op}_{self._n}"
        outs = [f"{name}/out{i}" for i in range(outputs)]
        self.nodes.append(self.h.make_node(op, inputs, outs, name=name, **attrs))
        return outs

    def one(self, op: str, inputs: list[str], **attrs) -> str:
        return self.op(op, inputs, **attrs)[0]

    # -- layers ------------------------------------------------------------------------------

    def linear(self, x: str, w: Param, b: Param | None, name: str) -> str:
        y = self.one("MatMul", [x, self.param(f"{name}.weight_t", lambda: _value_of(w).T.astype(np.float32))])
        if b is None:
            return y
        return self.one("Add", [y, self.param(f"{name}.bias", lambda: _value_of(b).astype(np.float32))])

    def layer_norm(self, x: str, get: Weights, prefix: str) -> str:
        return self.one(
            "LayerNormalization",
            [
                x,
                self.param(f"{prefix}.gamma", lambda: get(f"{prefix}/gamma")),
                self.param(f"{prefix}.beta", lambda: get(f"{prefix}/beta")),
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
        h = self.linear(
            h, _w(get, f"{prefix}/linear_0/weight"), _w(get, f"{prefix}/linear_0/bias"), f"{prefix}/linear_0"
        )
        h = self.gelu(h)
        return self.linear(
            h, _w(get, f"{prefix}/linear_1/weight"), _w(get, f"{prefix}/linear_1/bias"), f"{prefix}/linear_1"
        )


def _value_of(v: Param) -> np.ndarray:
    return v() if callable(v) else v


def _w(get: Weights, name: str, scale: float | None = None) -> Callable[[], np.ndarray]:
    """The CTranslate2 weight ``name`` (times ``scale``), read only when the graph is built from ``model.bin``."""
    if scale is None:
        return lambda: get(name)
    return lambda: get(name) * scale


def _qkv(get: Weights, prefix: str, d_model: int, scale: float) -> tuple[Param, Param]:
    """The fused q/k/v projection's weight and bias (``_scaled_qkv``), made only when read."""

    def made(part: int) -> Callable[[], np.ndarray]:
        return lambda: _scaled_qkv(get(f"{prefix}/weight"), get(f"{prefix}/bias"), d_model, scale)[part]

    return made(0), made(1)


def _scaled_qkv(w: np.ndarray, b: np.ndarray, d_model: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The fused [3d, d] q/k/v projection with the attention scale folded into the q rows."""
    w, b = w.copy(), b.copy()
    w[:d_model] *= scale
    b[:d_model] *= scale
    return w, b


def _value(name: str, shape: list, elem: int = 1):
    from onnx import helper

    return helper.make_tensor_value_info(name, elem, shape)


def build_encoder(dims: WhisperDims, get: Weights):
    """``encoder_model.onnx`` as an ``onnx.ModelProto``."""
    g = _Graph()
    x = _encoder_stem(g, get, dims)
    for i in range(dims.encoder_layers):
        x = _encoder_layer(g, get, x, i, dims)
    out = g.layer_norm(x, get, "encoder/layer_norm")
    g.nodes.append(g.h.make_node("Identity", [out], ["last_hidden_state"], name="output"))
    return g.model(
        "whisper_encoder",
        [_value("input_features", ["batch_size", dims.n_mels, "encoder_frames"])],
        [_value("last_hidden_state", ["batch_size", "encoder_sequence_length", dims.d_model])],
        PRODUCER,
    )


def _encoder_stem(g: _Graph, get: Weights, dims: WhisperDims) -> str:
    """The mel frames through both convolutions (each with GELU), as [B, T, d] plus their sinusoidal positions."""
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
    return g.one("Add", [x, g.one("Slice", [positions, zero, length, zero])])


def _encoder_layer(g: _Graph, get: Weights, x: str, i: int, dims: WhisperDims) -> str:
    """Encoder layer ``i``: pre-norm self-attention (unmasked) and MLP, each added to the residual."""
    p = f"encoder/layer_{i}"
    d, h = dims.d_model, dims.encoder_heads
    a = g.layer_norm(x, get, f"{p}/self_attention/layer_norm")
    w, b = _scaled_qkv(
        get(f"{p}/self_attention/linear_0/weight"), get(f"{p}/self_attention/linear_0/bias"), d, (d // h) ** -0.5
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
    return g.one("Add", [x, g.mlp(x, get, f"{p}/ffn")])


def build_decoder(dims: WhisperDims, get: Weights, with_past: bool):
    """``decoder_model.onnx`` (``with_past=False``) or ``decoder_with_past_model.onnx``."""
    return _decoder(dims, get, "past" if with_past else "first")


def build_decoder_step(dims: WhisperDims, capacity: int, get: Weights | None = None, stored: Stored | None = None):
    """The NPU's decoder step: every shape static, the self-attention cache a fixed ``capacity`` of slots.

    One token (``input_ids`` [1, 1]) at ``position_ids`` [1, 1] (its learned position), ``cache_mask``
    [1, P] (0 on the slots that hold earlier tokens, ``MASKED_SCORE`` on the rest),
    ``past_key_values.{i}.decoder.*`` [1, H, P, d/H] and ``past_key_values.{i}.encoder.*`` [1, H, T, d/H]
    (``build_cross_kv``) ->
    ``logits`` [1, 1, V] and ``present.{i}.decoder.key|value`` [1, H, 1, d/H]: the step's own key and value,
    which the caller writes into slot ``position`` of its cache. The step attends to the unmasked slots and
    to itself, which is what ``decoder_with_past_model.onnx`` computes over a past of exactly those tokens.
    The same layers as the other decoders (this module's ``_decoder``), the weights from ``get`` (the
    CTranslate2 weights) or ``stored`` (``decoder_model.onnx``'s initializers: an imported folder)."""
    if not 1 <= capacity <= dims.target_positions:
        raise ValueError(f"capacity {capacity}: from 1 to the model's {dims.target_positions} positions")
    return _decoder(dims, get, "step", capacity, stored)


def build_cross_kv(dims: WhisperDims, get: Weights | None = None, stored: Stored | None = None):
    """The NPU's cross-attention keys and values: ``encoder_hidden_states`` [1, T, d] ->
    ``present.{i}.encoder.key|value`` [1, H, T, d/H], as ``decoder_model.onnx`` computes them in its first step."""
    g = _Graph(stored)
    get = get or _no_weights
    d, h, t = dims.d_model, dims.decoder_heads, dims.source_positions
    outputs = []
    for i in range(dims.decoder_layers):
        ek, ev = _cross_kv(g, get, f"decoder/layer_{i}", d, h)
        for kind, v in (("key", ek), ("value", ev)):
            outputs.append(_value(_present(g, i, "encoder", kind, v), [1, h, t, d // h]))
    return g.model("whisper_cross_kv", [_value("encoder_hidden_states", [1, t, d])], outputs, PRODUCER)


def _no_weights(name: str) -> np.ndarray:
    raise KeyError(name)


def _cross_kv(g: _Graph, get: Weights, p: str, d: int, h: int) -> tuple[str, str]:
    kv = g.linear(
        "encoder_hidden_states",
        _w(get, f"{p}/attention/linear_1/weight"),
        _w(get, f"{p}/attention/linear_1/bias"),
        f"{p}/attention/kv",
    )
    ek, ev = g.op("Split", [kv, g.init(f"{p}.kvsplit", np.array([d, d], np.int64))], outputs=2, axis=-1)
    return g.heads(ek, h, d // h), g.heads(ev, h, d // h)


def _decoder(dims: WhisperDims, get: Weights | None, mode: str, capacity: int = 0, stored: Stored | None = None):
    """The decoder in one of its three forms: ``first`` (the prompt, cross keys/values from the encoder
    states), ``past`` (new tokens after a cache of any length) and ``step`` (``build_decoder_step``)."""
    g = _Graph(stored)
    get = get or _no_weights
    io = _DecoderIO.of(dims, mode, capacity)
    ids_shape = g.one("Shape", ["input_ids"])
    x = g.one("Gather", [g.param("embed_tokens", _w(get, "decoder/embeddings/weight")), "input_ids"], axis=0)
    positions = g.param("embed_positions", lambda: get("decoder/position_encodings/encodings")[: dims.target_positions])
    if mode == "step":
        x, mask = _step_positions(g, x, positions, capacity, io)
    else:
        x, mask = _sequence_positions(g, x, positions, ids_shape, dims, io)
    for i in range(dims.decoder_layers):
        x = _decoder_layer(g, get, x, mask, i, dims, io)
    if mode != "step":  # the step form has one position: nothing to leave out
        x = _last_positions(g, x, io)
    _head(g, get, x, g.one("Shape", [x], start=0, end=2), dims.d_model)
    names = {"first": "whisper_decoder", "past": "whisper_decoder_with_past", "step": "whisper_decoder_step"}
    return g.model(names[mode], io.inputs, [_value("logits", io.logits), *io.outputs], PRODUCER)


@dataclass(slots=True)
class _DecoderIO:
    """One decoder form's graph inputs and outputs, in order as its steps add them, and their shapes."""

    mode: str
    past: list  # past_key_values.{i}.decoder.key|value
    present: list  # present.{i}.decoder.key|value
    cross: list  # the encoder's keys and values: past_key_values.{i}.encoder.* or present.{i}.encoder.*
    logits: list
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    @classmethod
    def of(cls, dims: WhisperDims, mode: str, capacity: int) -> _DecoderIO:
        h, dh = dims.decoder_heads, dims.d_model // dims.decoder_heads
        if mode == "step":
            return cls(
                mode,
                past=[1, h, capacity, dh],
                present=[1, h, 1, dh],
                cross=[1, h, dims.source_positions, dh],
                logits=[1, 1, dims.vocab],
            )
        return cls(
            mode,
            past=["batch_size", h, "past_decoder_sequence_length", dh],
            present=[
                "batch_size",
                h,
                "total_decoder_sequence_length" if mode == "past" else "decoder_sequence_length",
                dh,
            ],
            cross=["batch_size", h, "encoder_sequence_length", dh],
            logits=["batch_size", "decoder_sequence_length", dims.vocab],
        )

    @property
    def cached(self) -> bool:
        """Whether the caches are inputs (``past``, ``step``); the ``first`` form computes the cross keys/values."""
        return self.mode != "first"


def _step_positions(g: _Graph, x: str, positions: str, capacity: int, io: _DecoderIO) -> tuple[str, str]:
    """The step's token plus its learned position (``position_ids``), and its attention mask: the cache's
    mask and the step's own slot (always seen), as [1, 1, 1, P + 1] over the scores."""
    x = g.one("Add", [x, g.one("Gather", [positions, "position_ids"], axis=0)])
    own = g.init("own_slot", np.zeros((1, 1), np.float32))
    mask = g.one(
        "Reshape",
        [
            g.one("Concat", ["cache_mask", own], axis=1),
            g.init("mask_shape", np.array([1, 1, 1, capacity + 1], np.int64)),
        ],
    )
    io.inputs += [
        _value("input_ids", [1, 1], 7),
        _value("position_ids", [1, 1], 7),
        _value("cache_mask", [1, capacity]),
    ]
    return x, mask


def _sequence_positions(
    g: _Graph, x: str, positions: str, ids_shape: str, dims: WhisperDims, io: _DecoderIO
) -> tuple[str, str]:
    """S new tokens after a past of P (none in the ``first`` form): their learned positions P .. P + S - 1,
    and the causal mask's rows P .. P + S - 1 over columns 0 .. P + S - 1."""
    zero = g.init("zero", np.array([0], np.int64))
    one = g.init("one", np.array([1], np.int64))
    two = g.init("two", np.array([2], np.int64))
    new_len = g.one("Slice", [ids_shape, one, two, zero])  # [S]
    if io.cached:
        past_len = g.one(
            "Slice",
            [
                g.one("Shape", ["past_key_values.0.decoder.key"]),
                two,
                g.init("three", np.array([3], np.int64)),
                zero,
            ],
        )
    else:
        past_len = zero
    total = g.one("Add", [past_len, new_len])
    x = g.one("Add", [x, g.one("Slice", [positions, past_len, total, zero])])
    causal = np.triu(np.full((dims.target_positions, dims.target_positions), MASKED_SCORE, np.float32), k=1)
    mask = g.one(
        "Slice",
        [
            g.init("causal_mask", causal),
            g.one("Concat", [past_len, zero], axis=0),
            g.one("Concat", [total, total], axis=0),
            g.init("axes01", np.array([0, 1], np.int64)),
        ],
    )
    io.inputs.append(_value("input_ids", ["batch_size", "decoder_sequence_length"], 7))
    if not io.cached:
        io.inputs.append(_value("encoder_hidden_states", ["batch_size", "encoder_sequence_length", dims.d_model]))
    return x, mask


def _decoder_layer(g: _Graph, get: Weights, x: str, mask: str, i: int, dims: WhisperDims, io: _DecoderIO) -> str:
    """Decoder layer ``i``: pre-norm self-attention, cross-attention and MLP, each added to the residual."""
    p = f"decoder/layer_{i}"
    x = g.one("Add", [x, _self_attention(g, get, x, mask, i, dims, io)])
    x = g.one("Add", [x, _cross_attention(g, get, x, i, dims, io)])
    return g.one("Add", [x, g.mlp(x, get, f"{p}/ffn")])


def _self_attention(g: _Graph, get: Weights, x: str, mask: str, i: int, dims: WhisperDims, io: _DecoderIO) -> str:
    """Layer ``i``'s masked self-attention over the cache (where there is one) and the new tokens."""
    p = f"decoder/layer_{i}/self_attention"
    d, h = dims.d_model, dims.decoder_heads
    dh = d // h
    a = g.layer_norm(x, get, f"{p}/layer_norm")
    qkv_w, qkv_b = _qkv(get, f"{p}/linear_0", d, dh**-0.5)
    qkv_out = g.linear(a, qkv_w, qkv_b, f"{p}/qkv")
    q, k, v = g.op(
        "Split", [qkv_out, g.init(f"decoder/layer_{i}.split", np.array([d, d, d], np.int64))], outputs=3, axis=-1
    )
    k, v = _self_cache(g, i, g.heads(k, h, dh), g.heads(v, h, dh), io)
    o = g.attend(g.heads(q, h, dh), k, v, mask)
    return g.linear(g.merge(o, d), _w(get, f"{p}/linear_1/weight"), _w(get, f"{p}/linear_1/bias"), f"{p}/out")


def _self_cache(g: _Graph, i: int, k: str, v: str, io: _DecoderIO) -> tuple[str, str]:
    """Layer ``i``'s self-attention cache: the past keys and values before the new ones (the cached forms'
    inputs), and the ``present`` outputs: the step its own key and value (the caller's cache has a slot for
    them), the other forms all of them. The keys and values to attend over."""
    new_k, new_v = k, v
    if io.cached:
        for kind in ("key", "value"):
            io.inputs.append(_value(f"past_key_values.{i}.decoder.{kind}", io.past))
        k = g.one("Concat", [f"past_key_values.{i}.decoder.key", k], axis=2)
        v = g.one("Concat", [f"past_key_values.{i}.decoder.value", v], axis=2)
    step = io.mode == "step"
    for kind, t in (("key", new_k if step else k), ("value", new_v if step else v)):
        io.outputs.append(_value(_present(g, i, "decoder", kind, t), io.present))
    return k, v


def _cross_attention(g: _Graph, get: Weights, x: str, i: int, dims: WhisperDims, io: _DecoderIO) -> str:
    """Layer ``i``'s attention over the encoder states' keys and values."""
    p = f"decoder/layer_{i}/attention"
    d, h = dims.d_model, dims.decoder_heads
    dh = d // h
    scale = dh**-0.5
    c = g.layer_norm(x, get, f"{p}/layer_norm")
    q = g.heads(
        g.linear(c, _w(get, f"{p}/linear_0/weight", scale), _w(get, f"{p}/linear_0/bias", scale), f"{p}/q"), h, dh
    )
    ek, ev = _cross_cache(g, get, i, dims, io)
    o = g.attend(q, ek, ev, None)
    return g.linear(g.merge(o, d), _w(get, f"{p}/linear_2/weight"), _w(get, f"{p}/linear_2/bias"), f"{p}/out")


def _cross_cache(g: _Graph, get: Weights, i: int, dims: WhisperDims, io: _DecoderIO) -> tuple[str, str]:
    """Layer ``i``'s cross keys and values: inputs of the cached forms; computed from the encoder states in the
    ``first`` form (once per utterance) and returned as its ``present.{i}.encoder.*`` outputs."""
    if io.cached:
        names = [f"past_key_values.{i}.encoder.{kind}" for kind in ("key", "value")]
        io.inputs += [_value(name, io.cross) for name in names]
        return names[0], names[1]
    ek, ev = _cross_kv(g, get, f"decoder/layer_{i}", dims.d_model, dims.decoder_heads)
    for kind, t in (("key", ek), ("value", ev)):
        io.outputs.append(_value(_present(g, i, "encoder", kind, t), io.cross))
    return ek, ev


def _present(g: _Graph, i: int, side: str, kind: str, tensor: str) -> str:
    """``tensor`` as the graph output ``present.{i}.{side}.{kind}`` (an Identity node); that name."""
    name = f"present.{i}.{side}.{kind}"
    g.nodes.append(g.h.make_node("Identity", [tensor], [name], name=f"present_{i}_{side[0]}{kind}"))
    return name


def _last_positions(g: _Graph, x: str, io: _DecoderIO) -> str:
    """``x`` [B, S, d] cut to its last ``logits_to_keep`` positions (an optional int64 scalar input, default
    0: all of them). A decode reads the logits of the positions after its prompt only: the context before
    them (Whisper's ``<|startofprev|>`` words, 69 tokens for the home tools) needs no vocabulary product."""
    io.inputs.append(_value(LOGITS_TO_KEEP, [], 7))
    g.inits.append(logits_to_keep_default())
    start = g.one("Neg", [g.one("Reshape", [LOGITS_TO_KEEP, g.init("one_dim", np.array([1], np.int64))])])
    end = g.init("int64_max", np.array([np.iinfo(np.int64).max], np.int64))
    return g.one("Slice", [x, start, end, g.init("sequence_axis", np.array([1], np.int64))])


def _head(g: _Graph, get: Weights, x: str, positions_shape: str, d: int) -> None:
    """The final LayerNorm and the tied output projection, as the output ``logits`` [B, S, V]: Gemm with
    transB reads the embedding table itself (one copy in the file). ``positions_shape``: [B, S] of ``x``."""
    x = g.layer_norm(x, get, "decoder/layer_norm")
    flat = g.one("Reshape", [x, g.init("flat_shape", np.array([-1, d], np.int64))])
    logits = g.one("Gemm", [flat, "embed_tokens"], transB=1)
    shape = g.one("Concat", [positions_shape, g.init("minus_one", np.array([-1], np.int64))], axis=0)
    g.nodes.append(g.h.make_node("Reshape", [logits, shape], ["logits"], name="logits"))
