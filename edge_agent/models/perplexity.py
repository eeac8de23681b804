"""Perplexity of a plain decoder export (a backend ``Session`` with ``past_key_values`` in, ``present`` out).

The windowing is the usual sliding one, and the same as ``scripts/gguf_reference.py`` computes with
transformers, so the two numbers compare:

- windows of ``window`` text tokens start every ``stride`` tokens (``stride <= window``); the last one
  ends at the text's end, and no window starts after it;
- with a BOS token (the tokenizer adds one) every window is fed as ``[BOS, tokens...]``, so the first
  token of each window is predicted too; without one, a window's first token is only context;
- each token is scored once, in the first window that reaches it, i.e. with the most context any
  window gives it: every token of the first window, then the tokens past the previous window's end.

A window is fed in chunks of ``chunk`` tokens with the KV cache carried (``present`` of one chunk is
the next chunk's ``past``), so memory stays bounded by ``chunk`` x vocabulary logits, never a whole
window's. Where the session has the optional ``logits_to_keep`` input (imported decoders), each chunk
asks only for the positions it scores. A session that gives the last position's logits only (a TensorRT
engine of such a decoder, ``backends.last_position_only``) takes the unscored head of a window in chunks
and then one token a call, each call's logits being the next scored position's. Log-probabilities are
taken in float64 (log-sum-exp), in row blocks, and the negative log-likelihood is summed in float64.

Besides perplexity the result holds each scored position's argmax: the token greedy decoding would
pick there, which the accuracy gate compares between an engine and FP32 (greedy agreement).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..backends import Session, is_stateful, last_position_only, optional_inputs
from ..errors import InputError, ModelError
from .tokenizer import Tokenizer

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ROWS = 32  # log-softmax rows at a time: 32 x 262,144 float64 is 64 MB
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Window:
    """One window: text tokens ``[begin, end)``; the tokens ``[score_from, end)`` are scored in it."""

    begin: int
    end: int
    score_from: int


@dataclass(slots=True)
class PerplexityResult:
    """Perplexity over the scored tokens, with what was run to get it."""

    perplexity: float
    nll: float  # summed negative log-likelihood, nats
    tokens: int  # tokens scored
    windows: int
    forwarded: int  # tokens fed to the model (windows overlap, BOS included)
    seconds: float
    argmax: np.ndarray = field(repr=False)  # int32 per scored token: the model's greedy choice there

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "nll": self.nll,
            "tokens": self.tokens,
            "windows": self.windows,
            "forwarded_tokens": self.forwarded,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


def text_tokens(tokenizer: Tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's token ids without special tokens, and the BOS id when the tokenizer adds one (what an
    empty text encodes to with special tokens: ``[BOS]`` for Gemma, nothing for Phi-3)."""
    specials = tokenizer.encode("", add_special_tokens=True)
    return tokenizer.encode(text, add_special_tokens=False), (specials[0] if specials else None)


def windows(n: int, window: int, stride: int, bos: bool = True) -> list[Window]:
    """The windows over ``n`` tokens and which tokens each scores (see the module doc).

    Without BOS a window's first token has no context in it and is not scored there (so a text's
    first token is never scored)."""
    if window < 1 or stride < 1:
        raise InputError(f"window ({window}) and stride ({stride}) must be at least 1")
    if stride > window:
        raise InputError(f"stride {stride} > window {window} would leave tokens out of every window")
    out: list[Window] = []
    scored_to = 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        first = max(scored_to, begin if bos else begin + 1)
        out.append(Window(begin, end, min(first, end)))
        scored_to = end
        if end == n:
            break
    return out


def _kv_shape(spec_shape: tuple, config: Mapping) -> tuple[int, int]:
    heads, head_dim = spec_shape[1], spec_shape[3]
    if not isinstance(heads, int):
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    if not isinstance(head_dim, int):
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return heads, head_dim


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Summed -log p(target) over rows of ``logits`` [rows, vocab], in float64; and each row's argmax."""
    total = 0.0
    picks = np.empty(len(targets), dtype=np.int32)
    for a in range(0, len(targets), _ROWS):
        rows = logits[a : a + _ROWS].astype(np.float64)
        top = rows.max(axis=-1)
        lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=-1))
        picked = rows[np.arange(len(rows)), targets[a : a + _ROWS]]
        total += float((lse - picked).sum())
        picks[a : a + len(rows)] = rows.argmax(axis=-1)
    return total, picks


class _Feeder:
    """Runs one window in chunks with the KV cache carried."""

    def __init__(self, session: Session, config: Mapping) -> None:
        if is_stateful(session):
            raise ModelError("perplexity needs a plain decoder export (past_key_values in, present out)")
        self.session = session
        self.past: list[tuple[str, str, tuple[int, int]]] = []
        names = {s.name for s in session.inputs}
        for spec in session.inputs:
            m = _PAST.match(spec.name)
            if m:
                self.past.append((spec.name, f"present.{m[1]}.{m[2]}", _kv_shape(spec.shape, config)))
            elif spec.name not in ("input_ids", "attention_mask", "position_ids"):
                raise ModelError(f"unexpected LLM input {spec.name!r} (not a plain KV-cache decoder export)")
        if "input_ids" not in names:
            raise ModelError("the model has no input_ids input (not a decoder export)")
        self.dtypes = {s.name: s.dtype for s in session.inputs}
        self.keep = "logits_to_keep" in optional_inputs(session)
        self.last_only = last_position_only(session)
        self.outputs = ["logits", *(present for _, present, _ in self.past)]

    def window(self, ids: Sequence[int], need_from: int, chunk: int) -> np.ndarray:
        """Logits of positions ``need_from ..`` of ``ids`` (the window as fed), ``[len(ids) - need_from, vocab]``."""
        cache = {name: np.zeros((1, heads, 0, dim), dtype=self.dtypes[name]) for name, _, (heads, dim) in self.past}
        parts: list[np.ndarray] = []
        n = len(ids)
        a = 0
        while a < n:
            b = min(a + chunk, n)
            if self.last_only:  # a call's one row is its last position: end each call where it is needed
                b = min(b, need_from + 1) if a < need_from else a + 1
            feeds: dict[str, np.ndarray] = {
                "input_ids": np.asarray([ids[a:b]], dtype=self.dtypes["input_ids"]),
                **cache,
            }
            if "attention_mask" in self.dtypes:
                feeds["attention_mask"] = np.ones((1, b), dtype=self.dtypes["attention_mask"])
            if "position_ids" in self.dtypes:
                feeds["position_ids"] = np.arange(a, b, dtype=self.dtypes["position_ids"])[None]
            wanted = b - max(a, need_from)  # a tail of this chunk (or nothing)
            if self.keep:  # 0 would mean every position: ask for one when none is wanted
                feeds["logits_to_keep"] = np.array(max(wanted, 1), dtype=np.int64)
            out = self.session.run(feeds, self.outputs)
            cache = {name: out[present] for name, present, _ in self.past}
            if wanted > 0:
                parts.append(np.asarray(out["logits"][0, -wanted:]))
            a = b
        return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)


def perplexity(
    session: Session,
    ids: Sequence[int],
    config: Mapping,
    *,
    bos: int | None,
    window: int = 1024,
    stride: int = 512,
    chunk: int = 256,
    progress: Progress | None = None,
) -> PerplexityResult:
    """Perplexity of ``ids`` (the text's tokens, no special tokens) under ``session``; ``bos`` is prepended
    to every window when given; ``config`` is the model's config.json (KV head sizes when the graph's
    shapes are symbolic)."""
    if chunk < 1:
        raise InputError(f"chunk ({chunk}) must be at least 1")
    plan = windows(len(ids), window, stride, bos is not None)
    total = sum(w.end - w.score_from for w in plan)
    if total == 0:
        raise InputError(f"no token to score: the text has {len(ids)} token(s)")
    feeder = _Feeder(session, config)
    lead = [bos] if bos is not None else []
    nll, scored, forwarded = 0.0, 0, 0
    picks: list[np.ndarray] = []
    t0 = time.perf_counter()
    for w in plan:
        fed = [*lead, *ids[w.begin : w.end]]
        # Position j of `fed` predicts fed[j + 1]; the text token t sits at j = t - begin + len(lead).
        first = w.score_from - w.begin + len(lead) - 1
        last = len(fed) - 1  # the final position predicts nothing, but logits_to_keep takes a tail
        if w.end <= w.score_from:
            continue
        forwarded += len(fed)
        logits = feeder.window(fed, first, chunk)[: last - first]
        targets = np.asarray(fed[first + 1 :], dtype=np.int64)
        window_nll, window_picks = _nll_rows(logits, targets)
        nll += window_nll
        scored += len(targets)
        picks.append(window_picks)
        if progress:
            progress(scored, total)
    seconds = time.perf_counter() - t0
    return PerplexityResult(
        perplexity=math.exp(nll / scored),
        nll=nll,
        tokens=scored,
        windows=len(plan),
        forwarded=forwarded,
        seconds=seconds,
        argmax=np.concatenate(picks),
    )
