"""Token selection: greedy, or temperature / top-k / top-p sampling with a per-request seed.

Pure numpy over one row of logits; the order follows the HF/vLLM convention: logit bias, repetition
penalty, frequency/presence penalties (OpenAI's: over the generated tokens), temperature, top-k,
top-p, then a draw. A request with a seed draws the same tokens every time, whatever else shares its
batch, because each request owns its generator. ``logprobs`` are taken from the processed logits
(bias, penalties and the output-format mask applied, before temperature): the distribution the
token was drawn from at temperature 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop; the defaults are greedy with no stop text."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off (CTRL-style: divide positive logits, multiply negative)
    max_repeats: int = 0  # 0 = off; stop after the same token this many times in a row
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0  # OpenAI's: minus penalty × count of each generated token
    presence_penalty: float = 0.0  # OpenAI's: minus penalty for each token generated at least once
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None = off; else how many most likely alternatives to report (0-20)
    grammar: str | None = None  # an llguidance grammar the output must follow (models.grammar)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            problems.append(f"temperature must lie in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer ≥ 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            problems.append(f"repetition_penalty must lie in (0, 10], got {self.repetition_penalty!r}")
        if not isinstance(self.max_repeats, int) or self.max_repeats < 0:
            problems.append(f"max_repeats must be an integer ≥ 0, got {self.max_repeats!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty text")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append(f"{name} must lie in [-2, 2], got {getattr(self, name)!r}")
        if any(not -100.0 <= b <= 100.0 for _t, b in self.logit_bias):
            problems.append("logit_bias values must lie in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            problems.append(f"top_logprobs must lie in [0, 20], got {self.logprobs!r}")
        if problems:
            raise InputError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Per-request token chooser; owns the request's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        p = params
        # argmax of the raw logits is the whole job: the scheduler takes it for many rows at once
        self.plain = (
            p.greedy
            and not p.logit_bias
            and p.repetition_penalty == 1.0
            and not p.frequency_penalty
            and not p.presence_penalty
            and p.logprobs is None
            and p.grammar is None
        )

    def process(
        self,
        logits: np.ndarray,
        history: Sequence[int],
        generated: Sequence[int] = (),
        allowed: np.ndarray | None = None,
    ) -> np.ndarray:
        """``logits`` [V] with the bias, the penalties and the ``allowed`` mask applied (a copy when changed)."""
        p = self.params
        repeat = p.repetition_penalty != 1.0 and bool(history)
        penalise = bool(p.frequency_penalty or p.presence_penalty) and bool(generated)
        if p.logit_bias or repeat or penalise:
            logits = logits.astype(np.float32, copy=True)  # one copy: the caller's row stays as it was
        for token, bias in p.logit_bias:
            if 0 <= token < logits.shape[-1]:
                logits[token] += bias
        if repeat:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            seen = seen[seen < logits.shape[-1]]
            vals = logits[seen]
            logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if penalise:
            ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            keep = ids < logits.shape[-1]
            logits[ids[keep]] -= counts[keep] * p.frequency_penalty + p.presence_penalty
        if allowed is not None:
            logits = np.where(allowed[: logits.shape[-1]], logits, -np.inf).astype(np.float32, copy=False)
        return logits

    def choose(
        self,
        logits: np.ndarray,
        history: Sequence[int],
        generated: Sequence[int] = (),
        allowed: np.ndarray | None = None,
    ) -> int:
        """The next token for one row of ``logits`` [V], given the ids so far (prompt + generated)."""
        return self.pick(self.process(logits, history, generated, allowed))

    def pick(self, logits: np.ndarray) -> int:
        """Draw from already processed logits (greedy, or temperature / top-k / top-p)."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < scaled.shape[-1]:
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = order[: int(np.searchsorted(cumulative, p.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self._rng.choice(probs.shape[-1], p=probs))


def repeated_too_often(generated: Sequence[int], max_repeats: int) -> bool:
    """Whether the last ``max_repeats`` generated tokens are all the same token."""
    return max_repeats > 0 and len(generated) >= max_repeats and len(set(generated[-max_repeats:])) == 1


def find_stop(text: str, stops: Sequence[str], searched_upto: int = 0) -> int | None:
    """Index where the earliest stop string starts in ``text``, looking only at new text."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, searched_upto - len(stop) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def logprobs_of(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under ``logits`` [V] (softmax at temperature 1) and the ``top``
    most likely tokens with theirs, most likely first."""
    row = logits.astype(np.float64)
    finite = np.isfinite(row)
    peak = row[finite].max() if finite.any() else 0.0
    logz = peak + np.log(np.exp(row[finite] - peak).sum())
    lp = row - logz
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, lp.shape[-1])
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        best = [(int(i), float(lp[i])) for i in idx if np.isfinite(lp[i])]
    return float(lp[token]), best
