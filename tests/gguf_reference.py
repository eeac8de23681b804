"""Reference forwards in numpy for the tiny decoders of ``tests/gguf_files.py``, written from transformers' modelling
code (``modeling_gemma3``, ``modeling_llama``, ``modeling_qwen2``, ``modeling_qwen3``, ``modeling_phi3``), not from
edge-agent's graph; and sentencepiece's BPE encoding, for the tokenizer.

The forward takes the Hugging Face layout weights ``make_weights`` drew (q/k rows unpermuted, Gemma's norm
parameters without the ``1 +``, phi3's projections unfused) and one unpadded sequence at positions 0…S-1,
in float32, and returns every position's logits.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

from tests.gguf_files import TinyConfig, bytes_to_unicode, gemma3_global

GEMMA3_LOCAL_BASE = 10_000.0  # transformers' Gemma3TextConfig.rope_local_base_freq


def _rms(x: np.ndarray, mult: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * mult).astype(np.float32)


def _rope(x: np.ndarray, base: float, linear: float = 1.0) -> np.ndarray:
    """``x`` [heads, S, D] rotated the rotate-half way (``apply_rotary_pos_emb``) at positions 0…S-1
    (divided by ``linear``: transformers' "linear" rope_type divides the inverse frequencies by it)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)) / linear
    freqs = np.arange(x.shape[1], dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return (x * cos + rotated * sin).astype(np.float32)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


def reference_logits(cfg: TinyConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits [S, vocab] of ``ids`` as transformers computes them (eager attention, float32)."""
    gemma = cfg.arch == "gemma3"
    H, KV, D, S = cfg.heads, cfg.kv_heads, cfg.head_dim, len(ids)

    def norm(name: str) -> np.ndarray:
        return (1.0 + w[name]) if gemma else w[name]  # Gemma3RMSNorm multiplies by (1 + weight)

    def lin(x: np.ndarray, name: str) -> np.ndarray:
        out = x @ w[f"{name}.weight"].T
        if f"{name}.bias" in w:
            out = out + w[f"{name}.bias"]
        return out.astype(np.float32)

    x = w["model.embed_tokens.weight"][ids]
    if gemma:
        x = x * np.float32(math.sqrt(cfg.hidden))
    pos = np.arange(S)
    behind = pos[:, None] - pos[None, :]  # query position - key position
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        window, base, linear = 0, cfg.rope_base, cfg.rope_linear
        if gemma and not gemma3_global(i):
            window, base, linear = cfg.window, GEMMA3_LOCAL_BASE, 1.0  # the local rotary embedding is unscaled
        elif cfg.arch == "phi3":
            window = cfg.window
        visible = behind >= 0
        if window > 0:
            visible &= behind < window
        h = _rms(x, norm(f"{p}.input_layernorm.weight"), cfg.eps)
        q = lin(h, f"{p}.self_attn.q_proj").reshape(S, H, D).transpose(1, 0, 2)
        k = lin(h, f"{p}.self_attn.k_proj").reshape(S, KV, D).transpose(1, 0, 2)
        v = lin(h, f"{p}.self_attn.v_proj").reshape(S, KV, D).transpose(1, 0, 2)
        if f"{p}.self_attn.q_norm.weight" in w:
            q = _rms(q, norm(f"{p}.self_attn.q_norm.weight"), cfg.eps)
            k = _rms(k, norm(f"{p}.self_attn.k_norm.weight"), cfg.eps)
        q, k = _rope(q, base, linear), _rope(k, base, linear)
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)  # repeat_kv
        scores = (q @ k.transpose(0, 2, 1)) * np.float32(D**-0.5)
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = (probs / probs.sum(axis=-1, keepdims=True)).astype(np.float32)
        ctx = (probs @ v).transpose(1, 0, 2).reshape(S, H * D)
        attn = lin(ctx, f"{p}.self_attn.o_proj")
        if gemma:
            attn = _rms(attn, norm(f"{p}.post_attention_layernorm.weight"), cfg.eps)
            x = x + attn
            h = _rms(x, norm(f"{p}.pre_feedforward_layernorm.weight"), cfg.eps)
        else:
            x = x + attn
            h = _rms(x, norm(f"{p}.post_attention_layernorm.weight"), cfg.eps)
        act = _gelu_tanh if gemma else _silu
        mlp = lin(act(lin(h, f"{p}.mlp.gate_proj")) * lin(h, f"{p}.mlp.up_proj"), f"{p}.mlp.down_proj")
        if gemma:
            mlp = _rms(mlp, norm(f"{p}.post_feedforward_layernorm.weight"), cfg.eps)
        x = (x + mlp).astype(np.float32)
    x = _rms(x, norm("model.norm.weight"), cfg.eps)
    head = w["model.embed_tokens.weight"] if cfg.tied else w["lm_head.weight"]
    return (x @ head.T).astype(np.float32)


def spm_bpe_encode(text: str, pieces: dict[str, int], scores: dict[str, float], dummy_prefix: bool) -> list[int]:
    """sentencepiece's BPE (``bpe_model.cc``): spaces as ``▁`` (and one in front with ``add_dummy_prefix``),
    characters as symbols, then again and again the adjacent pair whose concatenation is the best-scored
    piece is merged (the leftmost on a tie); a symbol not in the vocabulary becomes its UTF-8 bytes
    ``<0xXX>`` (byte fallback)."""
    text = text.replace(" ", "▁")
    if dummy_prefix:
        text = "▁" + text
    symbols = list(text)
    while True:
        best: tuple[float, int] | None = None
        for j in range(len(symbols) - 1):
            merged = symbols[j] + symbols[j + 1]
            if merged in scores and (best is None or scores[merged] > best[0]):
                best = (scores[merged], j)
        if best is None:
            break
        j = best[1]
        symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
    ids: list[int] = []
    for s in symbols:
        if s in pieces:
            ids.append(pieces[s])
        else:
            ids.extend(pieces[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
    return ids


# The pre-tokenizer splits of byte-level vocabularies (tokenizer.ggml.pre), from the models' own tokenizer
# definitions, in Python's re: letters are [^\W\d_], numbers \d (equal to \p{L} and \p{N} on text without
# underscores or non-decimal digits, which is what the tests feed).
_L = r"[^\W\d_]"
_BYTE_LEVEL_SPLITS = {
    "qwen2": rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?{_L}+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?{_L}+|\d{{1,3}}| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def byte_level_bpe_encode(text: str, pre: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """GPT-2's byte-level BPE: the pre-tokenizer's split, each piece's UTF-8 bytes as GPT-2's byte characters,
    then again and again the adjacent pair of lowest merge rank merged (the leftmost on a tie)."""
    table = bytes_to_unicode()
    ranks = {pair: i for i, pair in enumerate(merges)}
    ids: list[int] = []
    for word in re.findall(_BYTE_LEVEL_SPLITS[pre], text):
        parts = [table[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            rank, j = min((ranks.get((a, b), len(ranks)), j) for j, (a, b) in enumerate(itertools.pairwise(parts)))
            if rank == len(ranks):
                break
            parts[j : j + 2] = [parts[j] + parts[j + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids
