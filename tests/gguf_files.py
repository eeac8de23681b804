"""Tiny GGUF decoders with random weights, written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

``make_weights(cfg)`` draws seeded random weights in the Hugging Face layout (``model.layers.N.self_attn.q_proj.weight``
…, ``[out, in]``), already rounded through the block type each tensor is stored in, so a reference that
computes with them sees exactly the values the file holds. ``write_gguf`` then writes them under llama.cpp's
names and conventions: Gemma's norm weights as ``1 + w``, llama's q/k rows permuted for interleaved RoPE,
phi3's fused qkv and gate+up, qwen2's q/k/v biases; metadata keys as the converter writes them. Nothing of
edge-agent is used here.

Vocabularies: ``spm_vocab`` (``tokenizer.ggml.model = llama``: SentencePiece pieces with scores, byte
tokens ``<0x00>``…``<0xFF>``, control and user-defined tokens) built from an ordered merge list, and
``gpt2_vocab`` (byte-level, with merges).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
UNKNOWN, NORMAL, CONTROL, USER_DEFINED, BYTE = 2, 1, 3, 4, 6


@dataclass(frozen=True)
class Vocab:
    """A GGUF vocabulary: tokens, scores, types, optional merges, special ids."""

    model: str  # llama (SentencePiece) | gpt2
    tokens: list[str]
    scores: list[float]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    pad: int | None = None
    add_bos: bool = True
    pre: str | None = None
    space_prefix: bool | None = None  # tokenizer.ggml.add_space_prefix, written when set

    def id(self, token: str) -> int:
        return self.tokens.index(token)


# A SentencePiece BPE vocabulary is its merges in order: each merged piece scored by its rank (the first
# merge scores 0, the next -1, …), as sentencepiece's BPE trainer scores them.
SPM_MERGES = [
    ("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "a"), ("a", "n"), ("an", "d"), ("▁a", "nd"),
    ("o", "n"), ("e", "r"), ("▁", "w"), ("a", "t"), ("▁w", "at"), ("▁wat", "er"), ("▁", "b"), ("o", "i"),
    ("oi", "l"), ("▁b", "oil"), ("▁boil", "s"), ("in", "g"), ("▁", "s"), ("▁t", "o"), ("▁", "i"), ("▁i", "s"),
    ("r", "e"), ("▁", "c"), ("o", "l"), ("▁c", "ol"), ("d", "s"), ("l", "l"), ("e", "ll"), ("▁", "h"),
    ("▁h", "ell"), ("▁hell", "o"), ("o", "r"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld"),
]  # fmt: skip
SPM_CHARS = list("▁abcdefghijklmnopqrstuvwxyz.,!?'T")


def spm_vocab(extra_pieces: int = 0) -> Vocab:
    """A SentencePiece vocabulary: ``<unk> <s> </s>``, control and user-defined tokens, 256 byte tokens, the
    merged pieces of ``SPM_MERGES`` (rank order), single characters, then ``extra_pieces`` unused fillers."""
    tokens = ["<unk>", "<s>", "</s>", "<|end|>", "<|tool|>", "<mask>"]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED]
    scores = [0.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    scores += [0.0] * 256
    for rank, (left, right) in enumerate(SPM_MERGES):
        tokens.append(left + right)
        types.append(NORMAL)
        scores.append(-float(rank))
    for i, ch in enumerate(SPM_CHARS):
        tokens.append(ch)
        types.append(NORMAL)
        scores.append(-float(len(SPM_MERGES) + i))
    for i in range(extra_pieces):
        tokens.append(f"[PAD{i}]")
        types.append(5)  # unused
        scores.append(-1e4)
    assert len(set(tokens)) == len(tokens)
    return Vocab("llama", tokens, scores, types, bos=1, eos=2, unk=0, pad=0, add_bos=True)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (printable bytes map to themselves, the rest above U+0100)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


GPT2_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("n", "d"), ("Ġa", "nd"), ("a", "nd"),
    ("h", "and"), ("Ġ", "h"), ("Ġh", "and"), ("Ġthe", "n"), ("Ġ", "i"), ("Ġi", "n"),
]  # fmt: skip


def gpt2_vocab(extra: int = 0) -> Vocab:
    """A byte-level vocabulary: the 256 byte characters, the merged pieces of ``GPT2_MERGES``, control tokens."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)] + [a + b for a, b in GPT2_MERGES]
    tokens += [f"[extra{i}]" for i in range(extra)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [NORMAL] * (len(tokens) - 3) + [CONTROL] * 3
    eos = tokens.index("<|endoftext|>")
    return Vocab(
        "gpt2", tokens, [0.0] * len(tokens), types, merges=[f"{a} {b}" for a, b in GPT2_MERGES],
        bos=eos, eos=eos, pad=eos, add_bos=False, pre="qwen2",
    )  # fmt: skip


@dataclass(frozen=True)
class TinyConfig:
    """A tiny decoder's shape (one of the architectures the importer takes)."""

    arch: str  # gemma3 | llama | qwen2 | qwen3 | phi3
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: Vocab
    tied: bool
    eps: float = 1e-6
    rope_base: float = 10_000.0
    window: int = 0  # gemma3: sliding layers' window; phi3: every layer's (0 = none)
    context: int = 512
    per_layer_arrays: bool = False  # head counts and FFN width as one value per layer (arrays), as some files do
    rope_linear: float = 1.0  # linear RoPE scaling factor (rope.scaling.*); Gemma 3: global layers only
    seed: int = 0
    types: dict[str, Q] = field(default_factory=dict)  # GGUF tensor kind (attn_q, ffn_up, token_embd …) -> type

    @property
    def n_vocab(self) -> int:
        return len(self.vocab.tokens)


def gemma3_global(layer: int) -> bool:
    """transformers' Gemma 3: every 6th layer attends globally (``layer_types``)."""
    return (layer + 1) % 6 == 0


def _roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """``w`` as the file will hold it: through the block type and back (row-wise blocks, so row order is free)."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype).reshape(w.shape)


def make_weights(cfg: TinyConfig) -> dict[str, np.ndarray]:
    """Seeded random weights in the Hugging Face layout, rounded through their storage types.

    Norm weights are what the model multiplies by in transformers' terms: for Gemma the stored parameter
    ``w`` (its norm multiplies by ``1 + w``), for the others the multiplier itself."""
    rng = np.random.default_rng(cfg.seed)
    H, KV, D, E, F = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden, cfg.ffn
    gemma = cfg.arch == "gemma3"

    def lin(rows: int, cols: int, kind: str) -> np.ndarray:
        w = rng.normal(0.0, 1.0 / math.sqrt(cols), size=(rows, cols)).astype(np.float32)
        if cfg.arch == "phi3":  # fused tensors: one block type for the whole of attn_qkv and of ffn_up
            kind = {"attn_k": "attn_q", "attn_v": "attn_q", "ffn_gate": "ffn_up"}.get(kind, kind)
        return _roundtrip(w, cfg.types.get(kind, Q.F32))

    def norm(n: int) -> np.ndarray:
        w = rng.normal(0.0, 0.15, size=n).astype(np.float32)
        return w if gemma else (1.0 + w).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": _roundtrip(
            rng.normal(0.0, 1.0, size=(cfg.n_vocab, E)).astype(np.float32) * (0.2 if gemma else 1.0),
            cfg.types.get("token_embd", Q.F32),
        )
    }
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(E)
        w[f"{p}.self_attn.q_proj.weight"] = lin(H * D, E, "attn_q")
        w[f"{p}.self_attn.k_proj.weight"] = lin(KV * D, E, "attn_k")
        w[f"{p}.self_attn.v_proj.weight"] = lin(KV * D, E, "attn_v")
        w[f"{p}.self_attn.o_proj.weight"] = lin(E, H * D, "attn_output")
        if cfg.arch == "qwen2":
            for n, rows in (("q", H * D), ("k", KV * D), ("v", KV * D)):
                w[f"{p}.self_attn.{n}_proj.bias"] = rng.normal(0.0, 0.3, size=rows).astype(np.float32)
        if cfg.arch in ("gemma3", "qwen3"):
            w[f"{p}.self_attn.q_norm.weight"] = norm(D)
            w[f"{p}.self_attn.k_norm.weight"] = norm(D)
        w[f"{p}.post_attention_layernorm.weight"] = norm(E)
        if gemma:
            w[f"{p}.pre_feedforward_layernorm.weight"] = norm(E)
            w[f"{p}.post_feedforward_layernorm.weight"] = norm(E)
        w[f"{p}.mlp.gate_proj.weight"] = lin(F, E, "ffn_gate")
        w[f"{p}.mlp.up_proj.weight"] = lin(F, E, "ffn_up")
        w[f"{p}.mlp.down_proj.weight"] = lin(E, F, "ffn_down")
    w["model.norm.weight"] = norm(E)
    if not cfg.tied:
        w["lm_head.weight"] = lin(cfg.n_vocab, E, "output")
    return w


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (``LlamaModel.permute``): each head's halves interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, cfg: TinyConfig, w: dict[str, np.ndarray], *, name: str = "Tiny Test") -> Path:
    """Write ``w`` (from ``make_weights``) as a GGUF file in llama.cpp's layout for ``cfg.arch``."""
    arch = cfg.arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(cfg.layers)
    if cfg.per_layer_arrays:
        writer.add_feed_forward_length([cfg.ffn] * cfg.layers)
        writer.add_head_count([cfg.heads] * cfg.layers)
        writer.add_head_count_kv([cfg.kv_heads] * cfg.layers)
    else:
        writer.add_feed_forward_length(cfg.ffn)
        writer.add_head_count(cfg.heads)
        writer.add_head_count_kv(cfg.kv_heads)
    writer.add_layer_norm_rms_eps(cfg.eps)
    writer.add_rope_freq_base(cfg.rope_base)
    if cfg.rope_linear != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_linear)
    if arch in ("gemma3", "qwen3") or cfg.head_dim != cfg.hidden // cfg.heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.window)
    if arch == "phi3":
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_sliding_window(cfg.window)
    add_vocab(writer, cfg.vocab)

    shift = 1.0 if arch == "gemma3" else 0.0  # Gemma's converter stores 1 + w

    def put(gname: str, value: np.ndarray, kind: str | None = None) -> None:
        qtype = cfg.types.get(kind, Q.F32) if kind else Q.F32
        value = np.ascontiguousarray(value, dtype=np.float32)
        if qtype == Q.F32:
            writer.add_tensor(gname, value)
        elif qtype == Q.F16:
            writer.add_tensor(gname, value.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    put("token_embd.weight", w["model.embed_tokens.weight"], "token_embd")
    for i in range(cfg.layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        q, k, v = (w[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv")
        if arch == "llama":
            q, k = llama_permute(q, cfg.heads), llama_permute(k, cfg.kv_heads)
        if arch == "phi3":
            put(f"{b}.attn_qkv.weight", np.concatenate([q, k, v]), "attn_q")
        else:
            put(f"{b}.attn_q.weight", q, "attn_q")
            put(f"{b}.attn_k.weight", k, "attn_k")
            put(f"{b}.attn_v.weight", v, "attn_v")
        if arch == "qwen2":
            for n in "qkv":
                put(f"{b}.attn_{n}.bias", w[f"{p}.self_attn.{n}_proj.bias"])
        put(f"{b}.attn_output.weight", w[f"{p}.self_attn.o_proj.weight"], "attn_output")
        if arch in ("gemma3", "qwen3"):
            put(f"{b}.attn_q_norm.weight", w[f"{p}.self_attn.q_norm.weight"] + shift)
            put(f"{b}.attn_k_norm.weight", w[f"{p}.self_attn.k_norm.weight"] + shift)
        put(f"{b}.attn_norm.weight", w[f"{p}.input_layernorm.weight"] + shift)
        if arch == "gemma3":
            put(f"{b}.post_attention_norm.weight", w[f"{p}.post_attention_layernorm.weight"] + shift)
            put(f"{b}.ffn_norm.weight", w[f"{p}.pre_feedforward_layernorm.weight"] + shift)
            put(f"{b}.post_ffw_norm.weight", w[f"{p}.post_feedforward_layernorm.weight"] + shift)
        else:
            put(f"{b}.ffn_norm.weight", w[f"{p}.post_attention_layernorm.weight"])
        gate, up = w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]
        if arch == "phi3":
            put(f"{b}.ffn_up.weight", np.concatenate([gate, up]), "ffn_up")
        else:
            put(f"{b}.ffn_gate.weight", gate, "ffn_gate")
            put(f"{b}.ffn_up.weight", up, "ffn_up")
        put(f"{b}.ffn_down.weight", w[f"{p}.mlp.down_proj.weight"], "ffn_down")
    put("output_norm.weight", w["model.norm.weight"] + shift)
    if not cfg.tied:
        put("output.weight", w["lm_head.weight"], "output")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    """The tokenizer metadata as the converter writes it (``tokenizer.ggml.*``)."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.model == "llama":
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for key, value in (("bos", vocab.bos), ("eos", vocab.eos), ("unk", vocab.unk), ("pad", vocab.pad)):
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(value)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.space_prefix is not None:
        writer.add_add_space_prefix(vocab.space_prefix)
