"""DecodeBatch's left-padded cache: a row that grows on its own (a forced run) keeps every row's real
tokens contiguous at the right end, and the width stays that of the longest row (pad-only columns on the
left are trimmed), however the runs alternate. The cache holds each row's token ids (numpy reference:
the rows' own histories)."""

from __future__ import annotations

import numpy as np

from edge_agent.models.kv_batch import DecodeBatch


def cache(tokens: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A one-row "cache" whose values are the token ids themselves: [1, 1, n, 1], mask [1, n]."""
    return {"k": np.asarray(tokens, np.float32)[None, None, :, None]}, np.ones((1, len(tokens)), np.int64)


def row_tokens(batch: DecodeBatch, i: int) -> list[int]:
    start = batch.width - int(batch.mask[i].sum())
    assert not batch.mask[i, :start].any() and batch.mask[i, start:].all()  # pads left, then real tokens
    return batch.past["k"][i, 0, start:, 0].astype(int).tolist()


def test_rows_growing_on_their_own_stay_contiguous_and_the_width_that_of_the_longest():
    rng = np.random.default_rng(0)
    batch: DecodeBatch = DecodeBatch()
    histories = [list(range(1, 6)), list(range(10, 19))]
    for h in histories:
        past, mask = cache(h)
        batch.add([object()], past, mask)
    for _ in range(40):
        i = int(rng.integers(2))
        run = [int(t) for t in rng.integers(100, 200, int(rng.integers(1, 5)))]
        histories[i] += run
        past, mask = cache(row_tokens(batch, i) + run)  # the row's cache with its run appended
        start = batch.width - int(batch.mask[i].sum())
        mask = np.concatenate([batch.mask[i : i + 1, :start], mask], axis=1)  # its own left pads kept
        past = {"k": np.concatenate([batch.past["k"][i : i + 1, :, :start], past["k"]], axis=2)}
        batch.replace_row(i, past, mask)
        assert [row_tokens(batch, k) for k in range(2)] == histories
        assert batch.width == max(len(h) for h in histories)
