"""Perplexity of an LLM over held-out text (``edge-agent eval llm``, cli/eval.py).

    edge-agent eval llm --model gemma-3-270m --text calibration/llm/text/python-reference.txt [--json [OUT]]

The text is a UTF-8 file, or a JSONL manifest of ``{"text"}`` / ``{"prompt"}`` lines
(``engines/datasets.read_text_corpus``). The windowing and the arithmetic are ``models/perplexity.py``:
windows of ``window`` tokens every ``stride`` tokens, BOS first in each window when the tokenizer adds
one, every token scored once with the most context available, fed in chunks with the KV cache carried.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..backends import SessionOptions, open_session
from ..engines.datasets import read_text_corpus
from ..errors import InputError, ModelError
from ..models.catalog import resolve_model
from ..models.perplexity import perplexity, text_tokens
from ..models.tokenizer import Tokenizer


def evaluate(
    model: str,
    text_path: Path,
    *,
    window: int = 1024,
    stride: int = 512,
    max_tokens: int | None = None,
    chunk: int = 256,
    backend: str = "onnxruntime",
    threads: int = 1,
    cache_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """The report ``edge-agent eval llm --json`` prints."""
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"--max-tokens {max_tokens}: must be at least 1")
    text = read_text_corpus(text_path)
    ref = resolve_model(model, cache_dir)
    if ref.kind != "llm":
        raise ModelError(f"{ref.name} ({ref.path}) is not an LLM (kind {ref.kind}): perplexity needs a decoder")
    if ref.model_type in ("genai", "openvino-ir"):
        raise ModelError(
            f"{ref.name} ({ref.path}) is an {ref.model_type} folder; perplexity reads a plain decoder export "
            "(model.onnx with past_key_values inputs)"
        )
    ids, bos = text_tokens(Tokenizer(ref.path, ref.model_type), text)
    total_tokens = len(ids)
    if max_tokens:
        ids = ids[:max_tokens]
    options = SessionOptions(device="cpu" if backend == "onnxruntime" else "CPU", threads=threads)
    session = open_session(ref.path / "model.onnx", backend, options, warmup=lambda s: None)
    try:
        result = perplexity(
            session, ids, ref.config, bos=bos, window=window, stride=stride, chunk=chunk, progress=progress
        )
    finally:
        session.close()
    return {
        "model": ref.name,
        "model_path": str(ref.path),
        "text": str(text_path),
        "text_tokens": total_tokens,
        "max_tokens": max_tokens,
        "window": window,
        "stride": stride,
        "chunk": chunk,
        "bos": bos,
        "backend": backend,
        "threads": threads,
        **result.to_dict(),
    }
