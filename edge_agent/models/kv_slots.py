"""A KV cache in preallocated per-slot buffers, for exports whose attention writes in place.

onnxruntime-genai builds Phi-3 / Gemma with GroupQueryAttention and ``past_present_share_buffer``:
``past_key_values.N.*`` and ``present.N.*`` are the SAME buffer of a fixed capacity, each row's
tokens sit at the start of its slot (right padding), and the attention reads each row's length from
the attention mask (``seqlens_k = sum(mask) - 1``). So a decode step copies nothing: the runtime
appends one key/value per row where it lies. Rows join (prefilled alone into their slot) and leave
at step boundaries; leaving compacts the rows so the active ones stay a contiguous prefix.

A long prompt may be prefilled in chunks across several steps (``reserve``): its slot is the one
right after the active rows, outside every decode step, and holds ``pending_length`` tokens until
``commit`` makes it an active row (or ``release`` frees it). Compaction moves it along.

    buffers[name]  [max_rows, H_kv, capacity, D]   (zeros pages are only touched as used)
    lengths        tokens held per active row
    mask           [max_rows, capacity] int64: row i's first lengths[i] entries are 1 (a decode step's mask,
                   bound once: see ``full_step_mask``)

The capacity follows what the rows can reach (prompt + max_new_tokens, given at ``claim``/``reserve``),
in steps of ``GRANULE`` · 2^k up to ``limit`` (the model's context), not the context itself: the attention
of a decode step reads each head's keys and values at a stride of capacity × D, and a prompt's scratch
scores are heads × prompt × capacity, so a 4096-token capacity for 200-token chats costs time on both
(3–5% of a decode step and 15% of a 128-token prefill on a 28 M model). The buffers are reallocated
while the cache is empty (nothing to copy; shrinking only when 4× too large), and grown with a copy of the
rows held when a newcomer reaches further. Every reallocation drops ``prepared`` (the views moved).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from ..errors import InputError

Row = TypeVar("Row")


GRANULE = 256  # the smallest capacity, in tokens


class SlotCache(Generic[Row]):
    """Per-row KV slots in buffers sized to what the rows can reach; rows join and leave at step boundaries
    (see the module doc)."""

    def __init__(
        self, names: Sequence[str], max_rows: int, kv_heads: int, capacity: int, head_dim: int, dtype: str = "float32"
    ) -> None:
        self.limit = capacity  # the most tokens a row may hold
        self.max_rows = max_rows
        self._shape, self._dtype, self._names = (max_rows, kv_heads, head_dim), np.dtype(dtype), list(names)
        self.rows: list[Row] = []
        self.lengths: list[int] = []
        self.pending: Row | None = None  # a row being prefilled in chunks, in slot len(rows)
        self.pending_length = 0
        # sessions' runs with rows first…first+count-1 bound once, keyed (session id, first, count), and their
        # decode steps, keyed (session id, "decode", count): the views of a slot range stay the same memory
        # until the buffers are reallocated, which clears this (DecoderLM fills it)
        self.prepared: dict[tuple[int, int | str, int], Any] = {}
        self.capacity = 0
        self.buffers: dict[str, np.ndarray] = {}
        self.mask = np.zeros((max_rows, 0), dtype=np.int64)
        self._allocate(self._size_for(1))

    def _size_for(self, reach: int) -> int:
        size = min(GRANULE, self.limit)
        while size < reach and size < self.limit:
            size = min(size * 2, self.limit)
        return size

    def _allocate(self, capacity: int) -> None:
        """New buffers of ``capacity``, holding the active rows' (and a pending row's) tokens."""
        rows, heads, dim = self._shape
        # np.zeros maps fresh pages lazily: a capacity costs memory only as far as it is used
        buffers = {n: np.zeros((rows, heads, capacity, dim), dtype=self._dtype) for n in self._names}
        held = [*enumerate(self.lengths)] + (
            [(len(self.rows), self.pending_length)] if self.pending is not None else []
        )
        for slot, n in held:
            for name, buf in buffers.items():
                buf[slot, :, :n] = self.buffers[name][slot, :, :n]
        self.buffers, self.capacity = buffers, capacity
        self.mask = np.zeros((rows, capacity), dtype=np.int64)
        for slot, n in held:
            self._mask_row(slot, n)
        self.prepared.clear()

    def _fit(self, tokens: int, reach: int | None) -> None:
        """Size the buffers for a newcomer of ``tokens`` that may grow to ``reach`` (None: the limit)."""
        want = self._size_for(self.limit if reach is None else max(tokens, reach))
        empty = not self.rows and self.pending is None
        if want > self.capacity or (empty and want * 4 <= self.capacity):
            self._allocate(want)

    def __len__(self) -> int:
        return len(self.rows)

    def claim(self, row: Row, tokens: int, reach: int | None = None) -> int:
        """Reserve the next slot for ``row`` whose prompt has ``tokens`` tokens and that may grow to ``reach``
        tokens (default: the limit); returns the slot index."""
        self._check_free(tokens)
        if self.pending is not None:
            raise InputError("a chunked prefill holds the next KV slot: commit or release it first")
        self._fit(tokens, reach)
        self.rows.append(row)
        self.lengths.append(tokens)
        self._mask_row(len(self.rows) - 1, tokens)
        return len(self.rows) - 1

    def reserve(self, row: Row, tokens: int, reach: int | None = None) -> int:
        """Hold the next slot for ``row``, prefilled in chunks (``pending_length`` grows as they run);
        it joins decoding at ``commit``. Returns the slot index (it moves when rows leave)."""
        self._check_free(tokens)
        if self.pending is not None:
            raise InputError("only one chunked prefill at a time")
        self._fit(tokens, reach)
        self.pending, self.pending_length = row, 0
        return len(self.rows)

    def commit(self) -> None:
        """The pending row's prompt is in its slot: it becomes the last active row."""
        if self.pending is None:
            raise InputError("no chunked prefill to commit")
        self.rows.append(self.pending)
        self.lengths.append(self.pending_length)
        self._mask_row(len(self.rows) - 1, self.pending_length)
        self.release()

    def load_pending(self, kv: dict[str, np.ndarray]) -> None:
        """Put a prefix's KV (per name [1, H, n, D], a prefix cache's hit) at the start of the pending row's
        slot: it then holds those ``n`` tokens, and its prompt's next chunk runs after them."""
        if self.pending is None:
            raise InputError("no chunked prefill to load a prefix into")
        n = next(iter(kv.values())).shape[2] if kv else 0
        if n > self.capacity:
            raise InputError(f"a cached prefix of {n} tokens exceeds the KV capacity of {self.capacity}")
        slot = len(self.rows)
        for name, value in kv.items():
            self.buffers[name][slot, :, :n] = value[0]
        self.pending_length = n

    def row_kv(self, index: int, tokens: int) -> dict[str, np.ndarray]:
        """Views of row ``index``'s first ``tokens`` tokens' KV, per buffer name [H, tokens, D]."""
        return {name: buf[index, :, :tokens] for name, buf in self.buffers.items()}

    def release(self) -> None:
        """Forget the pending row (cancelled, failed); its slot is free again."""
        self.pending, self.pending_length = None, 0

    def _check_free(self, tokens: int) -> None:
        if len(self.rows) + (self.pending is not None) >= self.max_rows:
            raise InputError(f"all {self.max_rows} KV slots are in use")
        if tokens > self.limit:
            raise InputError(f"prompt of {tokens} tokens exceeds the KV capacity of {self.limit}")

    def make_room(self) -> None:
        """Before a decode step: grow the buffers if a row's next token would not fit (one that goes past
        the reach it was claimed with); at the limit, the step's mask refuses it."""
        need = max(self.lengths, default=0) + 1
        if need > self.capacity and self.capacity < self.limit:
            self._allocate(self._size_for(need))

    def views(self, first: int, count: int) -> dict[str, np.ndarray]:
        """Contiguous [count, H, capacity, D] views of rows ``first…first+count-1`` (past = present)."""
        return {n: b[first : first + count] for n, b in self.buffers.items()}

    def step_mask(self) -> np.ndarray:
        """Right-padded mask for one new token per row: row i has ``lengths[i] + 1`` ones."""
        lengths = np.asarray(self.lengths)
        width = int(lengths.max()) + 1
        if width > self.capacity:
            raise InputError(f"a sequence reached the KV capacity of {self.capacity} tokens")
        return (np.arange(width)[None, :] <= lengths[:, None]).astype(np.int64)

    def full_step_mask(self) -> np.ndarray:
        """The same step's mask at the full capacity width, [len(rows), capacity], in ``self.mask``: each row
        gets its next position set in place (GroupQueryAttention reads the row lengths from the mask's sums;
        only its width differs from ``step_mask``'s)."""
        mask = self.mask
        for i, n in enumerate(self.lengths):
            if n >= self.capacity:
                raise InputError(f"a sequence reached the KV capacity of {self.capacity} tokens")
            mask[i, n] = 1
        return mask[: len(self.rows)]

    def _mask_row(self, slot: int, length: int) -> None:
        self.mask[slot, :length] = 1
        self.mask[slot, length:] = 0

    def advance(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]

    def make_room_for(self, index: int, tokens: int) -> None:
        """Before row ``index`` takes ``tokens`` more on its own (a forced run): grow the buffers if they
        would not fit, within the limit; past it, an ``InputError``."""
        need = self.lengths[index] + tokens
        if need > self.limit:
            raise InputError(f"a sequence reached the KV capacity of {self.limit} tokens")
        if need > self.capacity:
            self._allocate(self._size_for(need))

    def grow(self, index: int, tokens: int) -> None:
        """Row ``index`` took ``tokens`` more into its slot (``make_room_for`` first)."""
        self.lengths[index] += tokens
        self._mask_row(index, self.lengths[index])

    def remove(self, indices: Sequence[int]) -> list[Row]:
        """Drop rows; move the survivors (and a pending row) down so they stay a contiguous prefix."""
        if not indices:
            return []
        drop = set(indices)
        removed = [self.rows[i] for i in sorted(drop)]
        keep = [i for i in range(len(self.rows)) if i not in drop]
        moves = [(dst, src, self.lengths[src]) for dst, src in enumerate(keep)]
        if self.pending is not None:
            moves.append((len(keep), len(self.rows), self.pending_length))
        for dst, src, n in moves:
            if dst != src:
                for buf in self.buffers.values():
                    buf[dst, :, :n] = buf[src, :, :n]
                self._mask_row(dst, n)
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        return removed
