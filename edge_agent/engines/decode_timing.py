"""Decode speed of LLM engines: batch-1 greedy tokens with the KV cache, the way the agent serves them.

A prefill is compute bound and says little about generation on a CPU, which is memory bound: each
new token reads every weight once. So an LLM engine's speed is timed as decode: the prompt is
prefilled (not timed), then ``new_tokens`` greedy steps, each feeding one token and the cache, are
timed through the agent's own model adapter (``DecoderLM``: the same feeds, cache handling and
in-place KV buffers for onnxruntime-genai folders as serving). Engines compared with each other
run in interleaved rounds on the same prompts, so background load on the device hits them alike;
the result per engine is the median milliseconds per token over every prompt of every round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..backends import Session
from ..models.catalog import ModelRef
from ..models.llm import DecoderLM

DECODE_ROUNDS = 3
DECODE_PROMPTS = 4
DECODE_TOKENS = 32


def adapter(ref: ModelRef, session: Session) -> DecoderLM:
    """The serving adapter over an already opened session of ``ref``'s model (or an engine of it), warmed up."""
    lm = DecoderLM(ref, session)
    lm.warmup()
    return lm


def decode_ms_per_token(lm: DecoderLM, prompt: Sequence[int], new_tokens: int = DECODE_TOKENS) -> float:
    """Milliseconds per greedy decode step after ``prompt`` (its prefill is not timed), through the calls
    the scheduler makes (``new_batch`` / ``join`` / ``decode``): in-place KV buffers for an in-place
    folder, the growing cache for a plain export."""
    batch = lm.new_batch(1)
    width = lm.vocab_limit
    # sized as the scheduler sizes a request's KV buffers: its prompt and the tokens it may make
    token = int(np.argmax(lm.join(batch, [None], [list(prompt)], reach=[len(prompt) + new_tokens + 1])[0, :width]))
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        token = int(np.argmax(lm.decode(batch, [token])[0, :width]))
    return (time.perf_counter() - t0) * 1e3 / max(new_tokens, 1)


def interleaved(
    engines: Mapping[str, DecoderLM],
    prompts: Sequence[Sequence[int]],
    rounds: int = DECODE_ROUNDS,
    new_tokens: int = DECODE_TOKENS,
    tick: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Per engine, ms/token of every prompt in every round; the engines take turns within each round."""
    if not prompts:
        raise ValueError("decode timing needs at least one prompt")
    out: dict[str, list[float]] = {name: [] for name in engines}
    done, total = 0, rounds * len(engines)
    for r in range(rounds):
        order = list(engines.items())
        if r % 2:  # alternate who goes first, so warming caches favour no one
            order.reverse()
        for name, lm in order:
            out[name].extend(decode_ms_per_token(lm, p, new_tokens) for p in prompts)
            done += 1
            if tick:
                tick(done, total)
    return out


def median(values: Sequence[float]) -> float:
    return float(np.median(values)) if values else 0.0
