"""The one sequence a stateful model holds: its KV cache lives inside the runtime's infer request.

The NPU runs LLMs one sequence at a time (OpenVINO's NPU plugin in its LLM mode): the KV cache is the
request's state, of a fixed capacity, and a new sequence starts with ``reset_state()``. This batch is
what the scheduler sees of it: at most one row, the number of tokens the state holds (which sizes the
attention mask and gives the next position), and the prompt tokens still to feed when a prompt is
prefilled in chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

Row = TypeVar("Row")


class StatefulBatch(Generic[Row]):
    """At most one row; ``length`` tokens in the runtime's KV state (see the module doc)."""

    max_rows = 1

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # tokens the state can hold
        self.rows: list[Row] = []
        self.length = 0
        self.pending: Row | None = None  # a row whose prompt is being fed in chunks (not in ``rows`` yet)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def busy(self) -> bool:
        return bool(self.rows) or self.pending is not None

    def step_feeds(self, ids: Sequence[int]) -> dict[str, np.ndarray]:
        """The feeds that append ``ids`` to the state (one sequence, no padding: positions follow on)."""
        total = self.length + len(ids)
        return {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.arange(self.length, total, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }

    def remove(self, indices: Sequence[int]) -> list[Row]:
        gone = [self.rows[i] for i in sorted(set(indices))]
        self.rows = [r for i, r in enumerate(self.rows) if i not in set(indices)]
        if not self.rows and self.pending is None:
            self.length = 0
        return gone
