"""What a GGUF's metadata says about the decoder, as one ``DecoderSpec`` and a Hugging Face ``config.json``.

Supported architectures (``general.architecture``), all one family of decoder graph (pre-norm, RoPE,
grouped-query attention, gated MLP), told apart by flags:

- gemma3: GQA with q/k RMS norms, 5 sliding-window layers to 1 global, pre and post norms around
  attention and MLP (sandwich), GELU (tanh); RoPE base 10,000 on sliding layers and ``rope.freq_base``
  on global ones; embeddings scaled by sqrt(hidden); head tied to the embedding table.
- llama: GQA, pre-norms, SiLU; llama.cpp's converter stores q/k rows permuted (interleaved RoPE
  pairs): undone here.
- qwen2: as llama, with q/k/v biases and no permutation; qwen3: as llama, with q/k RMS norms.
- phi3: fused qkv and fused gate+up weights, split here.

What the GGUF does not carry comes from the architecture's definition in transformers (Gemma 3: the
layer pattern, the local RoPE base, ``query_pre_attn_scalar`` = head size, no soft-capping). Norm
weights are stored as the multipliers themselves (llama.cpp's converter adds Gemma's ``1 +`` in).
Anything else is refused naming the architecture and this list. So are partial rotary embeddings, query
heads that do not group over the KV heads, and a tensor missing or shaped otherwise than the metadata
implies (``check_tensors``, before anything is written).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ModelError
from .gguf_file import MAX_CONTEXT, MAX_WIDTH, GgufFile, show

SUPPORTED = ("gemma3", "llama", "qwen2", "qwen3", "phi3")
_HF = {
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer attends globally (transformers' Gemma3TextConfig)
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """The decoder graph's shape and flags, per layer where layers differ."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    context: int
    activation: str  # gelu_tanh | silu
    rope_bases: tuple[float, ...]  # per layer
    rope_scale: tuple[float, ...]  # per layer: positions are divided by this (linear RoPE scaling)
    rotary_dim: int
    windows: tuple[int, ...]  # per layer: sliding window in tokens, -1 = global
    attn_scale: float
    embed_scale: float | None  # Gemma: sqrt(hidden)
    qk_norm: bool
    sandwich_norms: bool  # Gemma 3: post-attention and pre/post feed-forward norms
    qkv_bias: bool
    tied_head: bool
    llama_permuted_qk: bool


def _blocks(f: GgufFile) -> int:
    """How many blocks the file holds tensors for (``blk.N.*``, distinct N: at most the tensor count)."""
    return len({m.group(1) for t in f.tensor_infos() if (m := _BLOCK.match(t.name))})


def read_spec(f: GgufFile) -> DecoderSpec:
    """The ``DecoderSpec`` of ``f``; an unsupported architecture, a missing key or a value of the wrong kind or
    range (named with its value and what is allowed) raises ``ModelError``. ``block_count`` is checked against
    the blocks whose tensors the file holds before anything is built per layer."""
    arch = f.get("general.architecture")
    if arch not in SUPPORTED:
        raise ModelError(
            f"{f.path}: architecture {show(arch)} is not supported by models import (supported: {', '.join(SUPPORTED)})"
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    layers = _layer_count(f, key("block_count"))
    hidden = f.integer(key("embedding_length"), hi=MAX_WIDTH)
    heads = _per_layer_constant(f, key("attention.head_count"), layers, hidden)
    kv_heads = _per_layer_constant(f, key("attention.head_count_kv"), layers, heads, default=heads)
    head_dim = _head_dim(f, key, hidden, heads)
    ffn = _per_layer_constant(f, key("feed_forward_length"), layers, MAX_WIDTH)
    vocab = _vocab_rows(f, hidden)
    eps = f.number(key("attention.layer_norm_rms_epsilon"), below=1.0)
    context = f.integer(key("context_length"), 4096, hi=MAX_CONTEXT)
    base, factor, rotary_dim = _rope(f, key, head_dim)
    tied = not f.has_tensor("output.weight")
    if heads % kv_heads:
        raise ModelError(f"{f.path}: {heads} query heads do not group over {kv_heads} KV heads")

    if arch == "gemma3":
        window = f.integer(key("attention.sliding_window"), hi=MAX_CONTEXT)
        globals_ = [(i + 1) % GEMMA3_SLIDING_PATTERN == 0 for i in range(layers)]
        return DecoderSpec(
            arch, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, eps, context, "gelu_tanh",
            rope_bases=tuple(base if g else GEMMA3_LOCAL_ROPE_BASE for g in globals_),
            rope_scale=tuple(factor if g else 1.0 for g in globals_),
            rotary_dim=rotary_dim,
            windows=tuple(-1 if g else window for g in globals_),
            attn_scale=head_dim**-0.5,  # query_pre_attn_scalar = head size for Gemma 3
            embed_scale=math.sqrt(hidden),
            qk_norm=True, sandwich_norms=True, qkv_bias=False, tied_head=tied, llama_permuted_qk=False,
        )  # fmt: skip
    window = f.integer(key("attention.sliding_window"), 0, lo=0, hi=MAX_CONTEXT)
    return DecoderSpec(
        arch, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, eps, context, "silu",
        rope_bases=(base,) * layers,
        rope_scale=(factor,) * layers,
        rotary_dim=rotary_dim,
        windows=(window if window > 0 and arch == "phi3" else -1,) * layers,
        attn_scale=head_dim**-0.5,
        embed_scale=None,
        qk_norm=arch == "qwen3", sandwich_norms=False, qkv_bias=arch == "qwen2", tied_head=tied,
        llama_permuted_qk=arch == "llama",
    )  # fmt: skip


def _layer_count(f: GgufFile, block_count: str) -> int:
    """``block_count``, refused when the file holds no block tensors or tensors of fewer blocks."""
    blocks = _blocks(f)
    if blocks == 0:
        raise ModelError(f"{f.path}: no block tensors (blk.0.*): not a decoder this importer reads")
    layers = f.integer(block_count, hi=1 << 64)
    if layers > blocks:
        raise ModelError(
            f"{f.path}: metadata {block_count} is {layers:,}, but the file holds tensors of {blocks:,} blocks"
        )
    return layers


def _head_dim(f: GgufFile, key: Callable[[str], str], hidden: int, heads: int) -> int:
    """The attention head size: ``attention.key_length``, else hidden / heads; values of another size are refused."""
    if f.has(key("attention.key_length")):
        head_dim = f.integer(key("attention.key_length"), hi=MAX_WIDTH)
    elif hidden % heads:
        raise ModelError(
            f"{f.path}: no {key('attention.key_length')} and {key('embedding_length')} {hidden} is not a multiple "
            f"of {key('attention.head_count')} {heads}"
        )
    else:
        head_dim = hidden // heads
    if f.integer(key("attention.value_length"), head_dim, hi=MAX_WIDTH) != head_dim:
        raise ModelError(f"{f.path}: key and value head sizes differ; models import supports equal ones")
    return head_dim


def _vocab_rows(f: GgufFile, hidden: int) -> int:
    """The vocabulary size: the rows of ``token_embd.weight``, which must be ``[vocab, hidden]``."""
    embd = f.info("token_embd.weight")
    if len(embd.shape) != 2 or embd.shape[1] != hidden:
        raise ModelError(f"{f.path}: token_embd.weight is {list(embd.shape)}, expected [vocab, {hidden}]")
    return embd.shape[0]


def _rope(f: GgufFile, key: Callable[[str], str], head_dim: int) -> tuple[float, float, int]:
    """RoPE's base, linear scaling factor (1.0 when unscaled) and rotary size; other scalings and partial
    rotary embeddings are refused."""
    base = f.number(key("rope.freq_base"), 10_000.0)
    scaling = f.get(key("rope.scaling.type"), "none")
    factor = f.number(key("rope.scaling.factor"), 1.0)
    if scaling not in ("none", "linear") and factor != 1.0:
        raise ModelError(
            f"{f.path}: RoPE scaling {show(scaling)} is not supported by models import (none or linear only)"
        )
    factor = factor if scaling == "linear" else 1.0
    rotary_dim = f.integer(key("rope.dimension_count"), head_dim, hi=MAX_WIDTH)
    if rotary_dim != head_dim:
        raise ModelError(f"{f.path}: partial rotary embeddings ({rotary_dim} of {head_dim} per head) are not supported")
    return base, factor, rotary_dim


def tensor_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder graph reads, by GGUF name, with the shape (rows first) the metadata implies."""
    H, KV, D, E, F, V = spec.heads, spec.kv_heads, spec.head_dim, spec.hidden, spec.ffn, spec.vocab
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not spec.tied_head:
        shapes["output.weight"] = (V, E)
    for i in range(spec.layers):
        b = f"blk.{i}"
        shapes[f"{b}.attn_norm.weight"] = shapes[f"{b}.ffn_norm.weight"] = (E,)
        if spec.arch == "phi3":
            shapes[f"{b}.attn_qkv.weight"] = ((H + 2 * KV) * D, E)
            shapes[f"{b}.ffn_up.weight"] = (2 * F, E)
        else:
            shapes.update({f"{b}.attn_q.weight": (H * D, E), f"{b}.attn_k.weight": (KV * D, E)})
            shapes.update(
                {f"{b}.attn_v.weight": (KV * D, E), f"{b}.ffn_gate.weight": (F, E), f"{b}.ffn_up.weight": (F, E)}
            )
        if spec.qkv_bias:
            shapes.update({f"{b}.attn_q.bias": (H * D,), f"{b}.attn_k.bias": (KV * D,), f"{b}.attn_v.bias": (KV * D,)})
        if spec.qk_norm:
            shapes[f"{b}.attn_q_norm.weight"] = shapes[f"{b}.attn_k_norm.weight"] = (D,)
        if spec.sandwich_norms:
            shapes[f"{b}.post_attention_norm.weight"] = shapes[f"{b}.post_ffw_norm.weight"] = (E,)
        shapes[f"{b}.attn_output.weight"] = (E, H * D)
        shapes[f"{b}.ffn_down.weight"] = (E, F)
    return shapes


def check_tensors(f: GgufFile, spec: DecoderSpec) -> None:
    """Every tensor the graph reads is in ``f`` with the shape the metadata implies, else a ``ModelError``
    naming the tensor (checked before anything is written: a graph built otherwise fails at its first run)."""
    for name, want in tensor_shapes(spec).items():
        got = f.info(name).shape  # a missing tensor raises, naming it
        if got != want:
            raise ModelError(f"{f.path}: tensor {name!r} is {list(got)}, the metadata implies {list(want)}")


def _per_layer_constant(f: GgufFile, name: str, layers: int, hi: int, default: object = ...) -> int:
    """A value that may be given per layer (an array of ``layers`` items, all equal) or once; 1..``hi``."""
    value = f.get(name, default)
    if isinstance(value, np.ndarray):
        if value.size != layers:
            raise ModelError(f"{f.path}: metadata {name} has {value.size:,} values for {layers} layers")
        if value.dtype.kind not in "iu":
            raise ModelError(f"{f.path}: metadata {name} holds {value.dtype} values; it must hold integers")
        if len(np.unique(value)) != 1:
            raise ModelError(f"{f.path}: {name} differs between layers; models import supports uniform layers")
        value = int(value[0])
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
        raise ModelError(f"{f.path}: metadata {name} is {show(value)}; it must be an integer in 1..{hi:,}")
    return value


def hf_config(spec: DecoderSpec, bos_id: int | None, eos_ids: list[int], pad_id: int | None) -> dict:
    """A ``config.json`` in transformers' words for this decoder (what the agent and other tools read)."""
    model_type, cls = _HF[spec.arch]
    cfg: dict = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "rms_norm_eps": spec.eps,
        "max_position_embeddings": spec.context,
        "hidden_act": "gelu_pytorch_tanh" if spec.activation == "gelu_tanh" else "silu",
        "tie_word_embeddings": spec.tied_head,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    factor = max(spec.rope_scale)  # Gemma 3 scales its global layers only, which is what transformers reads
    if factor != 1.0:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if spec.arch == "gemma3":
        window = next(w for w in spec.windows if w > 0)
        global_base = next(b for b, w in zip(spec.rope_bases, spec.windows) if w < 0) if -1 in spec.windows else None
        cfg.update(
            {
                "sliding_window": window,
                "layer_types": ["full_attention" if w < 0 else "sliding_attention" for w in spec.windows],
                "rope_theta": global_base or GEMMA3_LOCAL_ROPE_BASE,
                "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
                "query_pre_attn_scalar": spec.head_dim,
                "attn_logit_softcapping": None,
                "final_logit_softcapping": None,
                "hidden_activation": "gelu_pytorch_tanh",
            }
        )
    else:
        cfg["rope_theta"] = spec.rope_bases[0]
        if spec.arch == "phi3" and spec.windows[0] > 0:
            cfg["sliding_window"] = spec.windows[0]
    return cfg
