"""The KV cache of sequences decoding together, for exports with ``past_key_values`` inputs.

Rows are left-padded to a common cache length: a row's real tokens sit contiguously at the right
end of every cache tensor, pads at the left are masked out (``attention_mask`` 0) and positions
count real tokens only. That keeps relative distances in cache-index space intact, which is what
Gemma-2's sliding-window mask measures. Sequences join (after their own prefill) and leave at step
boundaries; columns that only hold pads for every row are trimmed when rows leave.

    past[name]  [B, H_kv, P, D]     mask  [B, P]      (B rows, P cache columns)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

Row = TypeVar("Row")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [B, S] and mask [B, S] for prompts of different lengths, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _pad_columns(array: np.ndarray, axis: int, count: int) -> np.ndarray:
    if count == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (count, 0)
    return np.pad(array, widths)


class DecodeBatch(Generic[Row]):
    """Rows (per-request state objects) with their shared, left-padded KV cache and mask."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.past: dict[str, np.ndarray] = {}
        self.mask = np.zeros((0, 0), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def add(self, rows: Sequence[Row], past: dict[str, np.ndarray], mask: np.ndarray) -> None:
        """Join ``rows`` whose cache is ``past`` [n, H, Pn, D] and ``mask`` [n, Pn]."""
        if not self.rows:
            self.rows, self.past, self.mask = list(rows), dict(past), mask.copy()
            return
        width = max(self.width, mask.shape[1])
        self.past = {
            name: np.concatenate(
                [
                    _pad_columns(self.past[name], 2, width - self.width),
                    _pad_columns(past[name], 2, width - mask.shape[1]),
                ],
                axis=0,
            )
            for name in self.past
        }
        self.mask = np.concatenate(
            [_pad_columns(self.mask, 1, width - self.width), _pad_columns(mask, 1, width - mask.shape[1])], axis=0
        )
        self.rows.extend(rows)

    def row_kv(self, index: int, tokens: int) -> dict[str, np.ndarray]:
        """Views of row ``index``'s first ``tokens`` real tokens' KV, per past name [H, tokens, D] (its real
        tokens are contiguous after its left pads)."""
        start = self.width - int(self.mask[index].sum())
        return {name: value[index, :, start : start + tokens] for name, value in self.past.items()}

    def step_mask(self) -> np.ndarray:
        """The attention mask of the next decode step: the cache plus one real column per row."""
        return np.concatenate([self.mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)

    def advance(self, present: dict[str, np.ndarray], mask: np.ndarray) -> None:
        """After a decode step: its ``present`` and its ``step_mask()`` become the cache."""
        self.past, self.mask = present, mask

    def replace_row(self, index: int, past: dict[str, np.ndarray], mask: np.ndarray) -> None:
        """Row ``index`` grew on its own (a forced run of tokens): its cache is now ``past`` [1, H, Pn, D] and
        ``mask`` [1, Pn], Pn >= the batch's width; the other rows get pad columns on the left to match."""
        grow = mask.shape[1] - self.width
        if grow < 0:
            raise ValueError("a row's cache can only grow")
        self.past = {name: _pad_columns(value, 2, grow) for name, value in self.past.items()}
        self.mask = _pad_columns(self.mask, 1, grow)
        for name, value in past.items():
            self.past[name][index] = value[0]
        self.mask[index] = mask[0]
        self._trim()  # the row's own left pads may now be pads in every row

    def _trim(self) -> None:
        """Drop the columns on the left that hold pads in every row."""
        used = np.flatnonzero(self.mask.any(axis=0))
        start = int(used[0]) if used.size else self.mask.shape[1]
        if start:
            self.mask = np.ascontiguousarray(self.mask[:, start:])
            self.past = {name: np.ascontiguousarray(value[:, :, start:]) for name, value in self.past.items()}

    def remove(self, indices: Sequence[int]) -> list[Row]:
        """Drop rows (finished, cancelled, failed); trim pad-only columns on the left."""
        if not indices:
            return []
        drop = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in drop]
        removed = [self.rows[i] for i in sorted(drop)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.past, self.mask = {}, np.zeros((0, 0), dtype=np.int64)
            return removed
        self.mask = self.mask[keep]
        self.past = {name: value[keep] for name, value in self.past.items()}
        self._trim()
        return removed
