"""Perplexity over sliding windows (models/perplexity.py) against a hand computation on a toy decoder.

The toy decoder is numpy: the logits at a position are ``W @ (E[token] + mean of C[tokens so far])``,
its KV cache the ``C`` rows of the tokens seen. The reference runs each window whole (no cache, no
chunks), takes log-softmax by hand and scores each token once, in the first window that reaches it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_agent.backends import TensorSpec
from edge_agent.errors import InputError
from edge_agent.models.perplexity import Window, perplexity, windows

VOCAB, DIM = 11, 4
RNG = np.random.default_rng(7)
E, C, W = RNG.normal(size=(VOCAB, DIM)), RNG.normal(size=(VOCAB, DIM)), 3 * RNG.normal(size=(VOCAB, DIM))


def toy_logits(ids: list[int]) -> np.ndarray:
    """Every position's logits of one sequence fed whole."""
    ctx = np.cumsum(C[ids], axis=0) / np.arange(1, len(ids) + 1)[:, None]
    return (E[ids] + ctx) @ W.T


class ToySession:
    """The toy decoder behind the Session interface: one KV layer, float32, optional logits_to_keep."""

    backend = "numpy"

    def __init__(self, keep: bool) -> None:
        shape = ("batch", 1, "past", DIM)
        self.inputs = (
            TensorSpec("input_ids", "int64", ("batch", "seq")),
            TensorSpec("attention_mask", "int64", ("batch", "total")),
            TensorSpec("position_ids", "int64", ("batch", "seq")),
            TensorSpec("past_key_values.0.key", "float32", shape),
            TensorSpec("past_key_values.0.value", "float32", shape),
        )
        self.optional_inputs = (TensorSpec("logits_to_keep", "int64", ()),) if keep else ()
        self.outputs = ()
        self.calls: list[int] = []

    def run(self, feeds, output_names=None):
        ids = feeds["input_ids"][0].tolist()
        past = feeds["past_key_values.0.key"][0, 0].astype(np.float64)
        n_past = past.shape[0]
        assert feeds["attention_mask"].shape == (1, n_past + len(ids))
        assert feeds["position_ids"][0].tolist() == list(range(n_past, n_past + len(ids)))
        rows = np.concatenate([past, C[ids]])
        ctx = np.cumsum(rows, axis=0)[n_past:] / np.arange(n_past + 1, n_past + len(ids) + 1)[:, None]
        logits = ((E[ids] + ctx) @ W.T).astype(np.float32)
        keep = int(feeds.get("logits_to_keep", 0))
        if keep:
            logits = logits[-keep:]
        self.calls.append(len(ids))
        present = rows.astype(np.float32)[None, None]
        return {"logits": logits[None], "present.0.key": present, "present.0.value": present}

    def close(self) -> None:
        pass


def reference_nll(ids: list[int], bos: int | None, window: int, stride: int) -> tuple[float, int]:
    """Sliding-window NLL written out: each window whole, log-softmax by hand, each token scored once."""
    nll, scored, prev_end, begin = 0.0, 0, 0, 0
    while begin < len(ids):
        end = min(begin + window, len(ids))
        fed = ([bos] if bos is not None else []) + ids[begin:end]
        logits = toy_logits(fed).astype(np.float32).astype(np.float64)
        for j in range(len(fed) - 1):
            token = begin + j + (0 if bos is not None else 1)  # the text index fed[j + 1] has
            if token < prev_end:
                continue
            row = logits[j]
            nll -= row[fed[j + 1]] - math.log(sum(math.exp(v) for v in row))
            scored += 1
        prev_end = end
        if end == len(ids):
            break
        begin += stride
    return nll, scored


IDS = RNG.integers(3, VOCAB, size=50).tolist()


@pytest.mark.parametrize(
    ("n", "window", "stride", "bos"),
    [
        (50, 16, 8, 2),  # overlapping windows, the last one short
        (50, 16, 16, 2),  # stride = window: disjoint windows
        (50, 16, 5, 2),  # a stride that does not divide anything
        (50, 64, 8, 2),  # one window longer than the text
        (1, 16, 8, 2),  # one token: predicted from BOS alone
        (50, 16, 8, None),  # no BOS: a text's first token is never scored
        (50, 1, 1, 2),  # window of one: every token from BOS only
        (17, 16, 8, None),
    ],
)
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("keep", [False, True])
def test_perplexity_equals_the_hand_computation(n, window, stride, bos, chunk, keep) -> None:
    ids = IDS[:n]
    expected_nll, expected_scored = reference_nll(ids, bos, window, stride)
    result = perplexity(ToySession(keep), ids, {}, bos=bos, window=window, stride=stride, chunk=chunk)
    assert result.tokens == expected_scored == (n if bos is not None else n - 1)
    assert result.nll == pytest.approx(expected_nll, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected_nll / expected_scored), rel=1e-6)
    assert len(result.argmax) == expected_scored


def test_chunks_bound_each_call() -> None:
    session = ToySession(keep=True)
    perplexity(session, IDS, {}, bos=2, window=20, stride=10, chunk=6)
    assert max(session.calls) == 6
    assert sum(session.calls) == perplexity(ToySession(True), IDS, {}, bos=2, window=20, stride=10).forwarded


def test_argmax_is_each_scored_positions_greedy_choice() -> None:
    ids = IDS[:12]
    result = perplexity(ToySession(keep=False), ids, {}, bos=2, window=12, stride=12, chunk=5)
    expected = toy_logits([2, *ids])[:-1].astype(np.float32).argmax(axis=-1)
    assert result.argmax.tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("n", "window", "stride", "bos", "expected"),
    [
        (10, 4, 2, True, [Window(0, 4, 0), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]),
        (10, 4, 4, True, [Window(0, 4, 0), Window(4, 8, 4), Window(8, 10, 8)]),
        (10, 20, 5, True, [Window(0, 10, 0)]),
        (5, 4, 3, False, [Window(0, 4, 1), Window(3, 5, 4)]),
        (0, 4, 2, True, []),
    ],
)
def test_windows_table(n, window, stride, bos, expected) -> None:
    assert windows(n, window, stride, bos) == expected


@pytest.mark.parametrize(("window", "stride", "match"), [(4, 5, "stride 5 > window 4"), (0, 1, "at least 1")])
def test_bad_windows_are_refused(window, stride, match) -> None:
    with pytest.raises(InputError, match=match):
        windows(10, window, stride)


def test_nothing_to_score_is_an_error() -> None:
    with pytest.raises(InputError, match="no token to score"):
        perplexity(ToySession(False), [], {}, bos=2)
    with pytest.raises(InputError, match="no token to score"):
        perplexity(ToySession(False), [5], {}, bos=None)
