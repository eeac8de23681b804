"""The in-place KV graph: recovered decoder weights -> an ONNX model with GroupQueryAttention.

The layout is onnxruntime-genai's builder's (``Model.make_group_query_attention`` and friends):

    input_ids [B, S] int64, attention_mask [B, T] int64 (right padded; T = past + new)
    past_key_values.{i}.key/value [B, H_kv, capacity, D]  ==  present.{i}.key/value (one buffer, appended in place)
    seqlens_k = ReduceSum(attention_mask) - 1 (int32), total_sequence_length = T (int32)
    embed: Gather (* sqrt(hidden) for Gemma)
    per layer: SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (the residual adds ride on it),
               MatMul qkv (packed) -> com.microsoft.GroupQueryAttention (do_rotary with cos/sin caches, scale,
               softcap, local_window_size) -> MatMul o; MatMul gate, MatMul up -> act(gate) * up -> MatMul down
               (Gemma-2, Gemma 3: post-attention and pre/post-feed-forward norms; Gemma 3: separate q, k, v
               products, each head of q and k RMS-normed before GroupQueryAttention rotates it)
    final norm -> the last logits_to_keep positions -> MatMul lm_head (-> tanh soft-cap) -> logits [B, S', V]
    logits_to_keep: an optional int64 scalar input (default 0 = every position, S' = S; k > 0: the last k),
      as in the GGUF importer's graph; serving asks for the last position only

There is no position_ids input: GroupQueryAttention rotates each row at its own positions, read from
``seqlens_k``. Norm weights are the effective multipliers (Gemma's ``1 + w`` already applied). Each
distinct rotary base has its own cos/sin caches (Gemma 3: local on sliding layers, global on full ones).
A sliding window of ``w`` tokens (the query's own key included, as transformers counts it) is
GroupQueryAttention's ``local_window_size`` ``w`` (ONNX Runtime 1.32 counts the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .builder import GraphBuilder, kv_decoder_io, logits_to_keep_default

if TYPE_CHECKING:
    from ..engines.inplace_kv_weights import Arch, DecoderWeights


def rotary_caches(arch: Arch, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [context, rotary_dim / 2] in float32 for base ``theta``, as Hugging Face's default rotary
    embedding computes them."""
    dim = arch.rotary_dim
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    t = np.arange(arch.context, dtype=np.float32)
    freqs = np.outer(t, inv_freq).astype(np.float32)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


class _Graph(GraphBuilder):
    """Nodes named by the caller (``/model/layers.3/attn/...``, as onnxruntime-genai's builder names them),
    each output ``{node}/output_{i}``."""

    def node(self, op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        outs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(self.h.make_node(op, inputs, outs, name=name, domain=domain or None, **attrs))
        return outs


def build_graph(arch: Arch, w: DecoderWeights):
    """The in-place KV ``onnx.ModelProto`` of ``w`` (weights as initializers; save with external data)."""
    g = _Graph()
    one = _constants(g, arch)
    seqlens_k, total_len = _mask_lengths(g, one)
    delta = _embedding(g, w)  # what the next norm adds to the residual stream
    residual: str | None = None
    for i, lw in enumerate(w.layers):
        delta, residual = _layer(g, arch, i, lw, delta, residual, seqlens_k, total_len)
    _lm_head(g, arch, w, delta, residual)
    vocab = w.lm_head.shape[1]
    inputs, outputs = kv_decoder_io(arch.layers, arch.kv_heads, arch.head_dim, vocab, position_ids=False)
    g.inits.append(logits_to_keep_default())
    return g.model("inplace_kv_decoder", inputs, outputs, "edge-agent inplace-kv", domains=[("com.microsoft", 1)])


def _constants(g: _Graph, arch: Arch) -> str:
    """The initializers every layer shares: the int64 ones the mask subgraph uses (the name of the
    [1] one is returned) and the rotary cos/sin caches GroupQueryAttention reads (``cache_names``)."""
    one = g.init("/model/constants/INT64/[1]", np.array([1], dtype=np.int64))
    g.init("/model/constants/INT64/1", np.array(1, dtype=np.int64))
    for theta, (cos_name, sin_name) in cache_names(arch).items():
        cos, sin = rotary_caches(arch, theta)
        g.init(cos_name, cos)
        g.init(sin_name, sin)
    return one


def cache_names(arch: Arch) -> dict[float, tuple[str, str]]:
    """Rotary base -> the (cos, sin) cache initializers: ``cos_cache`` for the first layer's base, then
    ``cos_cache_1``… for each other base in layer order."""
    names: dict[float, tuple[str, str]] = {}
    for theta in arch.rope_thetas:
        if theta not in names:
            suffix = f"_{len(names)}" if names else ""
            names[theta] = (f"cos_cache{suffix}", f"sin_cache{suffix}")
    return names


def _mask_lengths(g: _Graph, one: str) -> tuple[str, str]:
    """The lengths GroupQueryAttention reads off the right-padded attention mask, as int32:
    ``seqlens_k`` (each row's ones, minus one) and ``total_sequence_length`` (the mask's width)."""
    from onnx import TensorProto

    base = "/model/attn_mask_reformat/attn_mask_subgraph"
    (total,) = g.node("ReduceSum", ["attention_mask", one], f"{base}/ReduceSum", keepdims=0)
    (seqlens,) = g.node("Sub", [total, one], f"{base}/Sub")
    (seqlens_k,) = g.node("Cast", [seqlens], f"{base}/Sub/Cast", to=TensorProto.INT32)
    (shape,) = g.node("Shape", ["attention_mask"], f"{base}/Shape")
    (width,) = g.node("Gather", [shape, "/model/constants/INT64/1"], f"{base}/Gather", axis=0)
    (total_len,) = g.node("Cast", [width], f"{base}/Gather/Cast", to=TensorProto.INT32)
    return seqlens_k, total_len


def _embedding(g: _Graph, w: DecoderWeights) -> str:
    """The token embeddings of ``input_ids`` (scaled where the family scales them: Gemma)."""
    table = g.init("model.embed_tokens.weight", w.embed)
    (hidden,) = g.node("Gather", [table, "input_ids"], "/model/embed_tokens/Gather")
    if w.embed_scale is not None:
        s = g.init("/model/embed_tokens/scale", np.array(w.embed_scale, dtype=np.float32))
        (hidden,) = g.node("Mul", [hidden, s], "/model/embed_tokens/Mul")
    return hidden


def _norm(g: _Graph, arch: Arch, name: str, x: str, weight: np.ndarray, skip: str | None) -> tuple[str, str | None]:
    """(normalized, new residual): a SkipSimplifiedLayerNorm when there is a residual to add x to."""
    wn = g.init(f"{name}.weight", weight)
    if skip is None:
        (y,) = g.node("SimplifiedLayerNormalization", [x, wn], f"/model/{name}/LayerNorm", axis=-1, epsilon=arch.eps)
        return y, None
    outs = g.node(
        "SkipSimplifiedLayerNormalization",
        [x, skip, wn],
        f"/model/{name}/SkipLayerNorm",
        outputs=4,
        domain="com.microsoft",
        epsilon=arch.eps,
    )
    return outs[0], outs[3]


def _layer(
    g: _Graph,
    arch: Arch,
    i: int,
    lw: dict[str, np.ndarray],
    delta: str,
    residual: str | None,
    seqlens_k: str,
    total_len: str,
) -> tuple[str, str | None]:
    """Decoder layer ``i``: its norms fold ``delta`` into the residual stream around the attention
    and the MLP; (what it adds to the residual stream, the residual stream before that)."""
    p = f"layers.{i}"
    if residual is None:  # first layer: the embedding itself is the residual stream
        x, _ = _norm(g, arch, f"{p}.input_layernorm", delta, lw["input_layernorm"], None)
        residual = delta
    else:
        x, residual = _norm(g, arch, f"{p}.input_layernorm", delta, lw["input_layernorm"], residual)
    o = _attention(g, arch, i, lw, x, seqlens_k, total_len)
    if arch.sandwich:
        o, _ = _norm(g, arch, f"{p}.post_attention_layernorm", o, lw["post_attention_layernorm"], None)
        x, residual = _norm(g, arch, f"{p}.pre_feedforward_layernorm", o, lw["pre_feedforward_layernorm"], residual)
    else:
        x, residual = _norm(g, arch, f"{p}.post_attention_layernorm", o, lw["post_attention_layernorm"], residual)
    delta = _mlp(g, arch, p, lw, x)
    if arch.sandwich:
        delta, _ = _norm(g, arch, f"{p}.post_feedforward_layernorm", delta, lw["post_feedforward_layernorm"], None)
    return delta, residual


def _attention(g: _Graph, arch: Arch, i: int, lw: dict[str, np.ndarray], x: str, seqlens_k: str, total_len: str) -> str:
    """Layer ``i``'s attention on ``x``: the packed qkv product (Gemma 3: q, k, v products and the q/k
    norms), GroupQueryAttention appending to the layer's KV buffers in place (``past_key_values.{i}.*``
    in, ``present.{i}.*`` out), the o product."""
    p = f"layers.{i}"
    if arch.qk_norm:
        qkv_in = _qkv_normed(g, arch, p, lw, x)
    else:
        w_qkv = g.init(f"{p}.attn.qkv_proj.weight", lw["qkv"])
        qkv_in = [g.node("MatMul", [x, w_qkv], f"/model/{p}/attn/qkv_proj/MatMul")[0], "", ""]
    past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
    cos, sin = cache_names(arch)[arch.rope_thetas[i]]
    attn = g.node(
        "GroupQueryAttention",
        [*qkv_in, past_k, past_v, seqlens_k, total_len, cos, sin],
        f"/model/{p}/attn/GroupQueryAttention",
        outputs=1,
        domain="com.microsoft",
        num_heads=arch.heads,
        kv_num_heads=arch.kv_heads,
        scale=arch.scale,
        softcap=arch.attn_softcap,
        local_window_size=arch.windows[i],
        do_rotary=1,
        rotary_interleaved=0,
    )[0]
    g.nodes[-1].output.extend([f"present.{i}.key", f"present.{i}.value"])
    return g.node("MatMul", [attn, g.init(f"{p}.attn.o_proj.weight", lw["o"])], f"/model/{p}/attn/o_proj/MatMul")[0]


def _qkv_normed(g: _Graph, arch: Arch, p: str, lw: dict[str, np.ndarray], x: str) -> list[str]:
    """Query, key and value of ``x`` as GroupQueryAttention's three inputs ([B, S, heads * head_dim]), each
    head of the query and the key RMS-normed (``SimplifiedLayerNormalization`` over [B, S, heads, head_dim])."""
    hq, hkv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    w = lw["qkv"]
    out = []
    for name, cols, heads in (("q", slice(0, hq), arch.heads), ("k", slice(hq, hq + hkv), arch.kv_heads)):
        mod = f"/model/{p}/attn/{name}_proj"
        (y,) = g.node("MatMul", [x, g.init(f"{p}.attn.{name}_proj.weight", w[:, cols])], f"{mod}/MatMul")
        split = g.init(f"{p}.attn.{name}_heads_shape", np.array([0, 0, heads, arch.head_dim], dtype=np.int64))
        (y,) = g.node("Reshape", [y, split], f"/model/{p}/attn/{name}_norm/Reshape")
        wn = g.init(f"{p}.attn.{name}_norm.weight", lw[f"self_attn.{name}_norm"])
        (y,) = g.node(
            "SimplifiedLayerNormalization", [y, wn], f"/model/{p}/attn/{name}_norm/LayerNorm", axis=-1, epsilon=arch.eps
        )
        merge = g.init(f"{p}.attn.{name}_merged_shape", np.array([0, 0, heads * arch.head_dim], dtype=np.int64))
        out.append(g.node("Reshape", [y, merge], f"/model/{p}/attn/{name}_norm/Reshape_1")[0])
    w_v = g.init(f"{p}.attn.v_proj.weight", w[:, hq + hkv :])
    out.append(g.node("MatMul", [x, w_v], f"/model/{p}/attn/v_proj/MatMul")[0])
    return out


def _mlp(g: _Graph, arch: Arch, p: str, lw: dict[str, np.ndarray], x: str) -> str:
    """The layer's feed-forward on ``x``: act(x @ gate) * (x @ up) @ down."""
    # Two products, not one packed product and a Split: the Split is a copy of both halves every step
    ffn = lw["gate_up"].shape[1] // 2
    (gate,) = g.node(
        "MatMul", [x, g.init(f"{p}.mlp.gate_proj.weight", lw["gate_up"][:, :ffn])], f"/model/{p}/mlp/gate/MatMul"
    )
    (up,) = g.node(
        "MatMul", [x, g.init(f"{p}.mlp.up_proj.weight", lw["gate_up"][:, ffn:])], f"/model/{p}/mlp/up/MatMul"
    )
    act = _activation(g, arch.activation, gate, f"/model/{p}/mlp/act")
    (prod,) = g.node("Mul", [act, up], f"/model/{p}/mlp/Mul")
    return g.node("MatMul", [prod, g.init(f"{p}.mlp.down_proj.weight", lw["down"])], f"/model/{p}/mlp/down/MatMul")[0]


def _lm_head(g: _Graph, arch: Arch, w: DecoderWeights, delta: str, residual: str | None) -> None:
    """The graph's ``logits`` output: the final norm of the residual stream, the lm_head product and,
    where the family caps them (Gemma-2), cap * tanh(logits / cap)."""
    from onnx import helper

    x, _ = _norm(g, arch, "norm", delta, w.final_norm, residual)
    shape = g.init("/model/constants/INT64/[-1]", np.array([-1], dtype=np.int64))
    (keep,) = g.node("Reshape", ["logits_to_keep", shape], "/model/logits_to_keep/Reshape")
    (start,) = g.node("Neg", [keep], "/model/logits_to_keep/Neg")  # -0 = 0: every position
    end = g.init("/model/constants/INT64/[max]", np.array([np.iinfo(np.int64).max], dtype=np.int64))
    (x,) = g.node("Slice", [x, start, end, "/model/constants/INT64/[1]"], "/model/logits_to_keep/Slice")
    logits_name = "logits" if not arch.final_softcap else "/model/lm_head/output"
    g.nodes.append(
        helper.make_node(
            "MatMul", [x, g.init("lm_head.weight", w.lm_head)], [logits_name], name="/model/lm_head/MatMul"
        )
    )
    if arch.final_softcap:
        cap = g.init("/model/softcap", np.array(arch.final_softcap, dtype=np.float32))
        (d,) = g.node("Div", [logits_name, cap], "/model/softcap/Div")
        (t,) = g.node("Tanh", [d], "/model/softcap/Tanh")
        g.nodes.append(helper.make_node("Mul", [t, cap], ["logits"], name="/model/softcap/Mul"))


def _activation(g: _Graph, kind: str, x: str, name: str) -> str:
    if kind == "silu":
        (sig,) = g.node("Sigmoid", [x], f"{name}/Sigmoid")
        return g.node("Mul", [x, sig], f"{name}/Mul")[0]
    op = "FastGelu" if kind == "gelu_tanh" else "Gelu"
    return g.node(op, [x], f"{name}/{op}", domain="com.microsoft")[0]
