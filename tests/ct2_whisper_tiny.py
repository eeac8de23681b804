"""A tiny random Whisper written as CTranslate2 writes it, and Whisper's forward pass in numpy.

The writer follows CTranslate2's ``specs/model_spec.py`` (binary version 6) and its int8 quantization
(per output row: ``scale = 127 / max|w|``, ``round(w * scale)``), independently of the agent's reader. The
numpy forward pass is OpenAI's Whisper written out plainly (no graph builder shared with the importer):
what the imported ONNX graphs are checked against.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEMO_WHISPER = REPO / "edge_agent" / "demo_models" / "demo-whisper"
D, HEADS, FFN, LAYERS, MELS, VOCAB, SRC, TGT = 64, 4, 128, 2, 80, 2029, 1500, 448
_DTYPE_ID = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<H", len(raw) + 1) + raw + b"\0"


def write_model_bin(
    path: Path, variables: dict[str, np.ndarray], aliases: dict[str, str], spec: str = "WhisperSpec"
) -> None:
    out = bytearray(struct.pack("<I", 6) + _string(spec) + struct.pack("<I", 3) + struct.pack("<I", len(variables)))
    for name, value in variables.items():
        out += _string(name) + struct.pack("<B", value.ndim) + b"".join(struct.pack("<I", d) for d in value.shape)
        out += struct.pack("<B", _DTYPE_ID[str(value.dtype)]) + struct.pack("<I", value.nbytes) + value.tobytes()
    out += struct.pack("<I", len(aliases))
    for a, t in aliases.items():
        out += _string(a) + _string(t)
    Path(path).write_bytes(bytes(out))


def sinusoids(length: int, channels: int) -> np.ndarray:
    inc = np.log(10000) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights by CTranslate2 variable name (a Whisper of width 64, 2 + 2 layers)."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, std: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    v: dict[str, np.ndarray] = {
        "encoder/conv1/weight": w(D, MELS, 3),
        "encoder/conv1/bias": w(D),
        "encoder/conv2/weight": w(D, D, 3),
        "encoder/conv2/bias": w(D),
        "encoder/position_encodings/encodings": sinusoids(SRC, D),
        "encoder/layer_norm/gamma": 1 + w(D),
        "encoder/layer_norm/beta": w(D),
        "decoder/embeddings/weight": w(VOCAB, D, std=0.3),
        "decoder/position_encodings/encodings": w(TGT, D),
        "decoder/layer_norm/gamma": 1 + w(D),
        "decoder/layer_norm/beta": w(D),
    }
    for side in ("encoder", "decoder"):
        for i in range(LAYERS):
            p = f"{side}/layer_{i}"
            blocks = ["self_attention", "ffn"] + (["attention"] if side == "decoder" else [])
            for b in blocks:
                v[f"{p}/{b}/layer_norm/gamma"] = 1 + w(D)
                v[f"{p}/{b}/layer_norm/beta"] = w(D)
            qkv_bias = w(3 * D)
            qkv_bias[D : 2 * D] = 0  # Whisper's key projection has no bias
            v |= {
                f"{p}/self_attention/linear_0/weight": w(3 * D, D),
                f"{p}/self_attention/linear_0/bias": qkv_bias,
                f"{p}/self_attention/linear_1/weight": w(D, D),
                f"{p}/self_attention/linear_1/bias": w(D),
                f"{p}/ffn/linear_0/weight": w(FFN, D),
                f"{p}/ffn/linear_0/bias": w(FFN),
                f"{p}/ffn/linear_1/weight": w(D, FFN),
                f"{p}/ffn/linear_1/bias": w(D),
            }
            if side == "decoder":
                kv_bias = w(2 * D)
                kv_bias[:D] = 0
                v |= {
                    f"{p}/attention/linear_0/weight": w(D, D),
                    f"{p}/attention/linear_0/bias": w(D),
                    f"{p}/attention/linear_1/weight": w(2 * D, D),
                    f"{p}/attention/linear_1/bias": kv_bias,
                    f"{p}/attention/linear_2/weight": w(D, D),
                    f"{p}/attention/linear_2/bias": w(D),
                }
    return v


def stored(weights: dict[str, np.ndarray], dtype: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(what the file stores, the float32 weights those stand for) for ``float32``, ``float16`` or ``int8``
    (CTranslate2's ``int8_float16``: linear and embedding weights int8 with a per-row float32 scale)."""
    out: dict[str, np.ndarray] = {}
    eff: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        quantizable = name.endswith("/weight") and "layer_norm" not in name
        if dtype == "int8" and quantizable:
            flat = value.reshape(value.shape[0], -1)
            scale = (127.0 / np.maximum(np.abs(flat).max(axis=1), 1e-12)).astype(np.float32)
            q = np.rint(flat * scale[:, None]).astype(np.int8)
            out[name], out[f"{name}_scale"] = q.reshape(value.shape), scale
            eff[name] = (q.astype(np.float32) / scale[:, None]).reshape(value.shape)
        elif dtype in ("float16", "int8"):
            out[name] = value.astype(np.float16)
            eff[name] = out[name].astype(np.float32)
        else:
            out[name] = eff[name] = value
    out |= {
        "encoder/num_heads": np.array(HEADS, np.int16),
        "decoder/num_heads": np.array(HEADS, np.int16),
        "decoder/pre_norm": np.array(1, np.int8),
        "decoder/scale_embeddings": np.array(0, np.int8),
    }
    return out, eff


def write_folder(folder: Path, dtype: str = "float16", seed: int = 0) -> dict[str, np.ndarray]:
    """A CTranslate2 Whisper folder with demo-whisper's tokenizer; returns the effective float32 weights."""
    folder.mkdir(parents=True, exist_ok=True)
    variables, eff = stored(random_weights(seed), dtype)
    write_model_bin(folder / "model.bin", variables, {"decoder/projection/weight": "decoder/embeddings/weight"})
    gen = json.loads((DEMO_WHISPER / "generation_config.json").read_text())
    config = {
        "suppress_ids": gen["suppress_tokens"],
        "suppress_ids_begin": gen["begin_suppress_tokens"],
        "lang_ids": sorted(gen["lang_to_id"].values()),
        "alignment_heads": [[1, 0]],
    }
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copyfile(DEMO_WHISPER / "tokenizer.json", folder / "tokenizer.json")
    return eff


# -- Whisper in numpy --------------------------------------------------------------------------


def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * g + b


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def _conv1d(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int) -> np.ndarray:
    """x [C, T], w [O, C, 3], padding 1."""
    xp = np.pad(x, ((0, 0), (1, 1)))
    t_out = (x.shape[1] + 2 - 3) // stride + 1
    cols = np.stack([xp[:, k : k + stride * t_out : stride] for k in range(3)], axis=-1)  # [C, T, 3]
    return np.einsum("ctk,ock->ot", cols, w) + b[:, None]


def _mha(q_in, kv_in, wq, bq, wk, bk, wv, bv, wo, bo, causal_offset: int | None):
    def split(x):
        return x.reshape(x.shape[0], HEADS, -1).transpose(1, 0, 2)

    q, k, v = split(q_in @ wq.T + bq), split(kv_in @ wk.T + bk), split(kv_in @ wv.T + bv)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(D // HEADS)
    if causal_offset is not None:
        i = np.arange(q.shape[1])[:, None] + causal_offset
        s = np.where(np.arange(k.shape[1])[None, :] <= i, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(1, 0, 2).reshape(q_in.shape[0], D)
    return o @ wo.T + bo


def encode(w: dict[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    """features [mels, F] -> [F / 2, D], float64 (F = 3000: 30 s; a shorter F takes the first F / 2 positions,
    whisper.cpp's audio_ctx)."""
    x = _gelu(_conv1d(features.astype(np.float64), w["encoder/conv1/weight"], w["encoder/conv1/bias"], 1))
    x = _gelu(_conv1d(x, w["encoder/conv2/weight"], w["encoder/conv2/bias"], 2)).T
    x = x + w["encoder/position_encodings/encodings"][: x.shape[0]]
    for i in range(LAYERS):
        p = f"encoder/layer_{i}"
        a = _ln(x, w[f"{p}/self_attention/layer_norm/gamma"], w[f"{p}/self_attention/layer_norm/beta"])
        qkv, b = w[f"{p}/self_attention/linear_0/weight"], w[f"{p}/self_attention/linear_0/bias"]
        x = x + _mha(
            a,
            a,
            qkv[:D],
            b[:D],
            qkv[D : 2 * D],
            b[D : 2 * D],
            qkv[2 * D :],
            b[2 * D :],
            w[f"{p}/self_attention/linear_1/weight"],
            w[f"{p}/self_attention/linear_1/bias"],
            None,
        )
        x = x + _ffn(w, p, x)
    return _ln(x, w["encoder/layer_norm/gamma"], w["encoder/layer_norm/beta"])


def _ffn(w, p, x):
    h = _ln(x, w[f"{p}/ffn/layer_norm/gamma"], w[f"{p}/ffn/layer_norm/beta"])
    h = _gelu(h @ w[f"{p}/ffn/linear_0/weight"].T + w[f"{p}/ffn/linear_0/bias"])
    return h @ w[f"{p}/ffn/linear_1/weight"].T + w[f"{p}/ffn/linear_1/bias"]


def decode_logits(w: dict[str, np.ndarray], hidden: np.ndarray, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), V] of one full causal pass over ``ids`` (no cache), float64."""
    x = w["decoder/embeddings/weight"][ids] + w["decoder/position_encodings/encodings"][: len(ids)]
    x = x.astype(np.float64)
    for i in range(LAYERS):
        p = f"decoder/layer_{i}"
        a = _ln(x, w[f"{p}/self_attention/layer_norm/gamma"], w[f"{p}/self_attention/layer_norm/beta"])
        qkv, b = w[f"{p}/self_attention/linear_0/weight"], w[f"{p}/self_attention/linear_0/bias"]
        x = x + _mha(
            a,
            a,
            qkv[:D],
            b[:D],
            qkv[D : 2 * D],
            b[D : 2 * D],
            qkv[2 * D :],
            b[2 * D :],
            w[f"{p}/self_attention/linear_1/weight"],
            w[f"{p}/self_attention/linear_1/bias"],
            0,
        )
        c = _ln(x, w[f"{p}/attention/layer_norm/gamma"], w[f"{p}/attention/layer_norm/beta"])
        kv, kb = w[f"{p}/attention/linear_1/weight"], w[f"{p}/attention/linear_1/bias"]
        x = x + _mha(
            c,
            hidden,
            w[f"{p}/attention/linear_0/weight"],
            w[f"{p}/attention/linear_0/bias"],
            kv[:D],
            kb[:D],
            kv[D:],
            kb[D:],
            w[f"{p}/attention/linear_2/weight"],
            w[f"{p}/attention/linear_2/bias"],
            None,
        )
        x = x + _ffn(w, p, x)
    x = _ln(x, w["decoder/layer_norm/gamma"], w["decoder/layer_norm/beta"])
    return x @ w["decoder/embeddings/weight"].T.astype(np.float64)
