"""The decoder ONNX graph of a ``DecoderSpec`` in the export contract the agent serves (docs/models.md).

    input_ids [B, S] int64, attention_mask [B, T] int64 (T = P + S), position_ids [B, S] int64,
    past_key_values.{i}.key/value [B, H_kv, P, D] float32
      -> logits [B, S', V] float32, present.{i}.key/value [B, H_kv, T, D]
    logits_to_keep: an optional int64 scalar input (default 0 = every position; k > 0 = the last k
      positions, S' = k). Serving asks for the last position only, which spares a 262k-row head a
      matmul per prompt token; scoring text (perplexity) leaves it at its default.

Only standard ONNX ops (opset 17), so ONNX Runtime, OpenVINO (and its NPU plugin) and TensorRT all
read it. Every layer's present is past + new: a sliding-window layer keeps the whole cache and applies
its window in the mask. Both masks come from positions, never from tensor shapes: a key at cache index
j has position ``cumsum(attention_mask)[j] - 1``, a query has its ``position_ids``; a key is visible
when its mask bit is set, its position is not after the query's and (sliding layers) it lies less
than the window behind. That holds for left padding, for chunked prefill and for a fixed-size cache
with unused slots masked out. Norms are RMS norms with the stored multiplier (Gemma's ``1 +`` is in
the weights). Grouped-query attention groups query heads per KV head by reshaping (no copies of K/V).

Nodes are named after transformers' modules the way ``torch.onnx.export`` names them
(``/model/layers.3/self_attn/q_proj/MatMul``, a norm's weight product ``…/input_layernorm/Mul_1``,
``/model/embed_tokens/Gather``, ``/lm_head/MatMul``), so ``engines.inplace_kv_weights`` recovers the
weights of an imported folder as it does those of a torch export.

Weights go to ``model.onnx.data`` as they are produced (page-aligned external data), so an import
holds one tensor at a time in memory besides the graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ModelError
from .builder import GraphBuilder, kv_decoder_io, logits_to_keep_default

if TYPE_CHECKING:
    from ..importers.gguf_arch import DecoderSpec

DATA_FILE = "model.onnx.data"
_ALIGN = 4096
MASK_MIN = float(np.finfo(np.float32).min)

WeightFn = Callable[[str], np.ndarray]  # GGUF tensor name -> float32, rows first
Rope = tuple[str, str]  # the cos and sin tables [B, 1, S, D] of one (base, scale)


class WeightFile:
    """Appends float32 tensors to the external data file and hands back ONNX initializers pointing at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("wb")
        self.bytes = 0

    def tensor(self, name: str, value: np.ndarray) -> Any:
        import onnx

        value = np.ascontiguousarray(value, dtype=np.float32)
        pad = (-self.bytes) % _ALIGN
        if pad:
            self._fh.write(bytes(pad))
            self.bytes += pad
        offset = self.bytes
        self._fh.write(value.tobytes())
        self.bytes += value.nbytes
        t = onnx.TensorProto()
        t.name = name
        t.data_type = onnx.TensorProto.FLOAT
        t.dims.extend(value.shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, val in (("location", self.path.name), ("offset", str(offset)), ("length", str(value.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, val
        return t

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()


class _Graph(GraphBuilder):
    """Nodes named after the module they belong to (``scope``), weights written to the data file as they come,
    constants shared by value."""

    def __init__(self, weights: WeightFile) -> None:
        super().__init__()
        self.weights = weights
        self._consts: dict[tuple, str] = {}
        self._n = 0
        self._names: dict[str, int] = {}
        self.scope = ""  # the module the next nodes belong to, named as torch.onnx names them

    def weight(self, name: str, value: np.ndarray) -> str:
        self.inits.append(self.weights.tensor(name, value))
        return name

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = f"const_{len(self._consts)}"
            self.inits.append(self.nh.from_array(arr, name))  # as it is: a scalar stays a scalar
            self._consts[key] = name
        return self._consts[key]

    def op(self, op: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        self._n += 1
        name = out or f"{op}_{self._n}"
        self.nodes.append(self.h.make_node(op, list(inputs), [name], name=self._node_name(op), **attrs))
        return name

    def _node_name(self, op: str) -> str:
        """``{scope}/{op}``, then ``_1``, ``_2``… for the next of that op in the scope (torch.onnx's names,
        which ``engines.inplace_kv_weights`` reads the modules from)."""
        if not self.scope:
            return f"n{self._n}_{op}"
        base = f"{self.scope}/{op}"
        count = self._names.get(base, 0)
        self._names[base] = count + 1
        return base if count == 0 else f"{base}_{count}"

    def rms(self, x: str, w: str, eps: float, scope: str) -> str:
        """RMS norm of ``x`` times ``w``, its nodes in module ``scope`` (the weight product is ``Mul_1``)."""
        outer, self.scope = self.scope, scope
        ms = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
        out = self.op("Div", x, self.op("Sqrt", self.op("Add", ms, self.const(eps))))
        out = self.op("Mul", out, w)
        self.scope = outer
        return out

    def linear(
        self, prefix: str, name: str, h: str, w: np.ndarray, bias: Callable[[], np.ndarray] | None = None
    ) -> str:
        """``h @ w.T`` (+ bias), the weights named ``{prefix}.{name}.weight``: prefix ``model.layers.3.self_attn``
        puts the nodes in ``/model/layers.3/self_attn/{name}`` (``…/MatMul``)."""
        outer = self.scope
        head, _, rest = prefix.partition(".layers.")
        layer, _, module = rest.partition(".")
        self.scope = f"/{head}/layers.{layer}/{module}/{name}"
        out = self.op("MatMul", h, self.weight(f"{prefix}.{name}.weight", np.ascontiguousarray(w.T)))
        if bias is not None:
            out = self.op("Add", out, self.weight(f"{prefix}.{name}.bias", bias()))
        self.scope = outer
        return out


def build_decoder(spec: DecoderSpec, get: WeightFn, folder: Path, progress: Callable[[int], None] | None = None) -> Any:
    """Write ``folder/model.onnx.data`` and return the ``onnx.ModelProto`` (save it next to the data)."""
    if spec.rotary_dim != spec.head_dim:
        raise ModelError(f"partial rotary embeddings ({spec.rotary_dim} of {spec.head_dim}) are not supported")
    if spec.heads % spec.kv_heads:
        raise ModelError(f"{spec.heads} query heads do not group over {spec.kv_heads} KV heads")
    wf = WeightFile(folder / DATA_FILE)
    g = _Graph(wf)
    try:
        embed, x = _embedding(g, spec, get)
        masks = _masks(g, spec)
        ropes = _rotary_tables(g, spec)
        for i in range(spec.layers):
            x = _layer(g, spec, get, i, x, masks[spec.windows[i]], ropes[(spec.rope_bases[i], spec.rope_scale[i])])
            if progress is not None:
                progress(i + 1)
        _head(g, spec, get, embed, x)
    finally:
        wf.close()
    inputs, outputs = kv_decoder_io(spec.layers, spec.kv_heads, spec.head_dim, spec.vocab, position_ids=True)
    g.inits.append(logits_to_keep_default())
    return g.model("decoder", inputs, outputs, "edge-agent")


def _embedding(g: _Graph, spec: DecoderSpec, get: WeightFn) -> tuple[str, str]:
    """(the embedding table, the embeddings of ``input_ids``: scaled where the family scales them, Gemma)."""
    embed = g.weight("model.embed_tokens.weight", get("token_embd.weight"))
    g.scope = "/model/embed_tokens"
    x = g.op("Gather", embed, "input_ids", axis=0)
    if spec.embed_scale is not None:
        x = g.op("Mul", x, g.const(np.float32(spec.embed_scale)))
    return embed, x


def _masks(g: _Graph, spec: DecoderSpec) -> dict[int, str]:
    """Window -> the additive attention mask [B, 1, S, T] of the layers with that window (-1: global): key
    positions from the attention mask, query positions as given (see the module doc)."""
    g.scope = "/model/attn_mask"
    key_pos = g.op("Sub", g.op("CumSum", "attention_mask", g.const(1, np.int64)), g.const(1, np.int64))
    key_pos = g.op("Unsqueeze", key_pos, g.const([1], np.int64))  # [B, 1, T]
    q_pos = g.op("Unsqueeze", "position_ids", g.const([2], np.int64))  # [B, S, 1]
    visible = g.op(
        "And",
        g.op("LessOrEqual", key_pos, q_pos),
        g.op("Unsqueeze", g.op("Equal", "attention_mask", g.const(1, np.int64)), g.const([1], np.int64)),
    )  # [B, S, T]
    masks: dict[int, str] = {}
    for window in sorted(set(spec.windows)):
        allowed = visible
        if window > 0:
            behind = g.op("Sub", q_pos, key_pos)
            allowed = g.op("And", visible, g.op("Less", behind, g.const(window, np.int64)))
        additive = g.op("Where", allowed, g.const(0.0), g.const(MASK_MIN))
        masks[window] = g.op("Unsqueeze", additive, g.const([1], np.int64))  # [B, 1, S, T]
    return masks


def _rotary_tables(g: _Graph, spec: DecoderSpec) -> dict[tuple[float, float], Rope]:
    """(rotary base, position scale) -> the cos and sin tables at ``position_ids``, one pair per distinct
    (base, scale) among the layers."""
    from onnx import TensorProto

    D = spec.head_dim
    g.scope = "/model/rotary_emb"
    pos_f = g.op("Cast", "position_ids", to=TensorProto.FLOAT)
    ropes: dict[tuple[float, float], Rope] = {}
    for base, scale in sorted(set(zip(spec.rope_bases, spec.rope_scale))):
        exponents = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)
        inv_freq = (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)
        p = pos_f if scale == 1.0 else g.op("Div", pos_f, g.const(np.float32(scale)))
        freqs = g.op("Mul", g.op("Unsqueeze", p, g.const([2], np.int64)), g.const(inv_freq))  # [B, S, D/2]
        emb = g.op("Concat", freqs, freqs, axis=-1)
        ropes[(base, scale)] = (
            g.op("Unsqueeze", g.op("Cos", emb), g.const([1], np.int64)),
            g.op("Unsqueeze", g.op("Sin", emb), g.const([1], np.int64)),
        )
    return ropes


def _layer(g: _Graph, spec: DecoderSpec, get: WeightFn, i: int, x: str, mask: str, rope: Rope) -> str:
    """Decoder layer ``i`` on the residual stream ``x``: x + attention(norm(x)), then + mlp(norm(x))."""
    blk, pre, mod = f"blk.{i}", f"model.layers.{i}", f"/model/layers.{i}"
    norm_w = g.weight(f"{pre}.input_layernorm.weight", get(f"{blk}.attn_norm.weight"))
    h = g.rms(x, norm_w, spec.eps, f"{mod}/input_layernorm")
    attn = _attention(g, spec, get, i, h, mask, rope)
    if spec.sandwich_norms:
        post = g.weight(f"{pre}.post_attention_layernorm.weight", get(f"{blk}.post_attention_norm.weight"))
        attn = g.rms(attn, post, spec.eps, f"{mod}/post_attention_layernorm")
    g.scope = mod
    x = g.op("Add", x, attn)

    ffn_w = g.weight(f"{pre}.pre_feedforward_layernorm.weight", get(f"{blk}.ffn_norm.weight"))
    # transformers' module: the pre-MLP norm is post_attention_layernorm unless the layer has sandwich norms
    ffn_scope = "pre_feedforward_layernorm" if spec.sandwich_norms else "post_attention_layernorm"
    h = g.rms(x, ffn_w, spec.eps, f"{mod}/{ffn_scope}")
    mlp = _mlp(g, spec, get, i, h)
    if spec.sandwich_norms:
        post = g.weight(f"{pre}.post_feedforward_layernorm.weight", get(f"{blk}.post_ffw_norm.weight"))
        mlp = g.rms(mlp, post, spec.eps, f"{mod}/post_feedforward_layernorm")
    g.scope = mod
    return g.op("Add", x, mlp)


def _attention(g: _Graph, spec: DecoderSpec, get: WeightFn, i: int, h: str, mask: str, rope: Rope) -> str:
    """Layer ``i``'s self-attention on the normed ``h`` [B, S, hidden]: the q, k and v products (q/k norms
    where the family has them), rotary embeddings, the cache (``_cache``), attention over it, the o product."""
    H, KV = spec.heads, spec.kv_heads
    blk, pre, mod = f"blk.{i}", f"model.layers.{i}", f"/model/layers.{i}"
    wq, wk, wv = _qkv_weights(spec, get, blk)
    bias = {n: _getter(get, f"{blk}.attn_{n}.bias") if spec.qkv_bias else None for n in "qkv"}
    q = g.linear(f"{pre}.self_attn", "q_proj", h, wq, bias["q"])
    k = g.linear(f"{pre}.self_attn", "k_proj", h, wk, bias["k"])
    v = g.linear(f"{pre}.self_attn", "v_proj", h, wv, bias["v"])
    q_norm = k_norm = None
    if spec.qk_norm:
        q_norm = g.weight(f"{pre}.self_attn.q_norm.weight", get(f"{blk}.attn_q_norm.weight"))
        k_norm = g.weight(f"{pre}.self_attn.k_norm.weight", get(f"{blk}.attn_k_norm.weight"))
    cos, sin = rope
    g.scope = f"{mod}/self_attn"
    q = _rotate(g, spec, _heads(g, spec, q, H, q_norm, f"{mod}/self_attn/q_norm"), cos, sin)
    k = _rotate(g, spec, _heads(g, spec, k, KV, k_norm, f"{mod}/self_attn/k_norm"), cos, sin)
    v = _heads(g, spec, v, KV, None)
    k, v = _cache(g, i, k, v)
    ctx = _attend(g, spec, q, k, v, mask)
    return g.linear(f"{pre}.self_attn", "o_proj", ctx, get(f"{blk}.attn_output.weight"))


def _qkv_weights(spec: DecoderSpec, get: WeightFn, blk: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q, k and v weights [out, in] of block ``blk`` (phi3's fused qkv split, llama's q/k rows unpermuted)."""
    H, KV, D = spec.heads, spec.kv_heads, spec.head_dim
    if spec.arch == "phi3":
        qkv = get(f"{blk}.attn_qkv.weight")
        wq, wk, wv = np.split(qkv, [H * D, H * D + KV * D], axis=0)
    else:
        wq, wk, wv = (get(f"{blk}.attn_{n}.weight") for n in ("q", "k", "v"))
    if spec.llama_permuted_qk:
        wq, wk = _unpermute(wq, H), _unpermute(wk, KV)
    return wq, wk, wv


def _getter(get: WeightFn, name: str) -> Callable[[], np.ndarray]:
    return lambda: get(name)


def _heads(g: _Graph, spec: DecoderSpec, t: str, n: int, norm: str | None, norm_scope: str = "") -> str:
    """[B, S, n * D] -> [B, n, S, D], each head RMS-normed by ``norm`` when there is one."""
    t = g.op("Reshape", t, g.const([0, 0, n, spec.head_dim], np.int64))
    if norm is not None:
        t = g.rms(t, norm, spec.eps, norm_scope)
    return g.op("Transpose", t, perm=[0, 2, 1, 3])  # [B, n, S, D]


def _rotate(g: _Graph, spec: DecoderSpec, t: str, cos: str, sin: str) -> str:
    """Rotary embedding of ``t`` [B, n, S, D] (halves, not interleaved pairs): t * cos + rotate_half(t) * sin."""
    D = spec.head_dim
    half = D // 2
    x1 = g.op("Slice", t, g.const([0], np.int64), g.const([half], np.int64), g.const([-1], np.int64))
    x2 = g.op("Slice", t, g.const([half], np.int64), g.const([D], np.int64), g.const([-1], np.int64))
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", t, cos), g.op("Mul", rotated, sin))


def _cache(g: _Graph, i: int, k: str, v: str) -> tuple[str, str]:
    """Layer ``i``'s cache I/O: the new keys and values appended to ``past_key_values.{i}.*``, which are the
    ``present.{i}.*`` outputs [B, KV, T, D] (and what attention reads)."""
    k = g.op("Concat", f"past_key_values.{i}.key", k, axis=2, out=f"present.{i}.key")
    v = g.op("Concat", f"past_key_values.{i}.value", v, axis=2, out=f"present.{i}.value")
    return k, v


def _attend(g: _Graph, spec: DecoderSpec, q: str, k: str, v: str, mask: str) -> str:
    """softmax(q kᵀ * scale + mask) v for q [B, H, S, D] over k, v [B, KV, T, D] -> [B, S, H * D]. Grouped
    query heads are reshaped onto their KV head ([B, KV, G * S, D]), so K and V are never copied."""
    H, KV, D = spec.heads, spec.kv_heads, spec.head_dim
    groups = H // KV
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2])  # [B, KV, D, T]
    if groups > 1:
        q = g.op("Reshape", q, g.const([0, KV, -1, D], np.int64))  # [B, KV, G*S, D]
    scores = g.op("Mul", g.op("MatMul", q, kt), g.const(np.float32(spec.attn_scale)))
    if groups > 1:
        scores = g.op("Reshape", scores, g.const([0, H, -1, 0], np.int64))  # [B, H, S, T]
    probs = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
    if groups > 1:
        probs = g.op("Reshape", probs, g.const([0, KV, -1, 0], np.int64))
    ctx = g.op("MatMul", probs, v)
    if groups > 1:
        ctx = g.op("Reshape", ctx, g.const([0, H, -1, D], np.int64))
    return g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.const([0, 0, H * D], np.int64))


def _mlp(g: _Graph, spec: DecoderSpec, get: WeightFn, i: int, h: str) -> str:
    """Layer ``i``'s feed-forward on the normed ``h``: act(h @ gate) * (h @ up) @ down (phi3's fused gate+up split)."""
    blk, pre, mod = f"blk.{i}", f"model.layers.{i}", f"/model/layers.{i}"
    if spec.arch == "phi3":
        w_gate, w_up = np.split(get(f"{blk}.ffn_up.weight"), 2, axis=0)
    else:
        w_gate, w_up = get(f"{blk}.ffn_gate.weight"), get(f"{blk}.ffn_up.weight")
    gate = g.linear(f"{pre}.mlp", "gate_proj", h, w_gate)
    up = g.linear(f"{pre}.mlp", "up_proj", h, w_up)
    g.scope = f"{mod}/mlp/act_fn"
    act = _gelu_tanh(g, gate) if spec.activation == "gelu_tanh" else g.op("Mul", gate, g.op("Sigmoid", gate))
    g.scope = f"{mod}/mlp"
    return g.linear(f"{pre}.mlp", "down_proj", g.op("Mul", act, up), get(f"{blk}.ffn_down.weight"))


def _head(g: _Graph, spec: DecoderSpec, get: WeightFn, embed: str, x: str) -> None:
    """The ``logits`` output: the final norm, the last ``logits_to_keep`` positions (0: all), the lm_head
    product (the embedding table, transposed, when the head is tied)."""
    final = g.weight("model.norm.weight", get("output_norm.weight"))
    x = g.rms(x, final, spec.eps, "/model/norm")
    g.scope = "/model"
    keep = g.op("Neg", g.op("Reshape", "logits_to_keep", g.const([1], np.int64)))
    x = g.op("Slice", x, keep, g.const([np.iinfo(np.int64).max], np.int64), g.const([1], np.int64))
    g.scope = "/lm_head"
    if spec.tied_head:
        head = g.op("Transpose", embed, perm=[1, 0])
    else:
        head = g.weight("lm_head.weight", np.ascontiguousarray(get("output.weight").T))
    g.op("MatMul", x, head, out="logits")


def _gelu_tanh(g: _Graph, x: str) -> str:
    cube = g.op("Mul", g.op("Mul", x, x), x)
    inner = g.op(
        "Mul", g.op("Add", x, g.op("Mul", cube, g.const(np.float32(0.044715)))), g.const(np.float32(0.7978845608028654))
    )
    return g.op(
        "Mul", g.op("Mul", x, g.const(np.float32(0.5))), g.op("Add", g.op("Tanh", inner), g.const(np.float32(1.0)))
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's q/k row permutation (interleaved RoPE pairs back to halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
