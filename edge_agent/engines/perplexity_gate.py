"""The accuracy gate's perplexity: a recipe's ``[perplexity]`` text scored by FP32 and by each candidate.

The text is tokenized with the model's own tokenizer and cut to ``max_tokens``; windows, BOS and
chunks are ``models/perplexity.py``'s (as ``edge-agent eval llm``). FP32's result (its perplexity and
the argmax at every scored token) is the same for every candidate of a model, backend and runtime, so
it is kept once in ``<engine cache>/perplexity/<key>.npz`` and each candidate's build reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..backends import Session
from ..models.catalog import ModelRef
from ..models.perplexity import PerplexityResult, perplexity, text_tokens
from ..models.tokenizer import Tokenizer
from .datasets import read_text_corpus
from .recipes import PerplexitySpec, Recipe

Progress = Callable[[int, int], None]


def spec_of(recipe: Recipe) -> PerplexitySpec:
    if recipe.perplexity is None:
        raise ValueError(f"recipe {recipe.name} has no [perplexity] section")
    return recipe.perplexity


def text_path(recipe: Recipe) -> Path:
    return recipe.resolve(spec_of(recipe).data)


def token_ids(recipe: Recipe, ref: ModelRef) -> tuple[list[int], int | None]:
    """The held-out text's ids (cut to ``max_tokens``) and the BOS id the model's tokenizer adds, if any."""
    spec = spec_of(recipe)
    ids, bos = text_tokens(Tokenizer(ref.path, ref.model_type), read_text_corpus(text_path(recipe)))
    return (ids[: spec.max_tokens] if spec.max_tokens else ids), bos


def measure(recipe: Recipe, ref: ModelRef, session: Session, progress: Progress | None = None) -> PerplexityResult:
    spec = spec_of(recipe)
    ids, bos = token_ids(recipe, ref)
    return perplexity(
        session, ids, ref.config, bos=bos, window=spec.window, stride=spec.stride, chunk=spec.chunk, progress=progress
    )


def reference_key(recipe: Recipe, model_hash: str, backend: str, runtime_version: str | None) -> str:
    """What FP32's result depends on: the model, the text and its windows, the backend and its version."""
    spec = spec_of(recipe)
    parts = {
        "model": model_hash,
        "onnx_file": recipe.onnx_file,
        "text": hashlib.sha256(text_path(recipe).read_bytes()).hexdigest(),
        "max_tokens": spec.max_tokens,
        "window": spec.window,
        "stride": spec.stride,
        "backend": backend,
        "runtime_version": runtime_version,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def reference(
    recipe: Recipe, ref: ModelRef, open_fp32: Callable[[], Session], memo: Path, progress: Progress | None = None
) -> tuple[dict, np.ndarray]:
    """FP32's perplexity report and its argmax per scored token: from ``memo`` (an .npz) when there,
    else measured with a session from ``open_fp32`` and kept there."""
    if memo.is_file():
        try:
            with np.load(memo) as kept:
                return json.loads(str(kept["report"])), np.asarray(kept["argmax"])
        except (OSError, ValueError, KeyError):  # a torn file: measure again
            pass
    session = open_fp32()
    try:
        result = measure(recipe, ref, session, progress)
    finally:
        session.close()
    report = result.to_dict()
    memo.parent.mkdir(parents=True, exist_ok=True)
    partial = memo.with_name(f".{memo.stem}.{os.getpid()}.npz")
    np.savez(partial, report=np.asarray(json.dumps(report)), argmax=result.argmax)
    os.replace(partial, memo)
    return report, result.argmax
