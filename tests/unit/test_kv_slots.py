"""SlotCache bookkeeping: right-padded step masks, capacity checks, compaction on leave."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.models.kv_slots import SlotCache


def filled(lengths: list[int], capacity: int = 8) -> SlotCache:
    cache: SlotCache[str] = SlotCache(["0.key"], max_rows=4, kv_heads=1, capacity=capacity, head_dim=1)
    for i, n in enumerate(lengths):
        slot = cache.claim(f"r{i}", n)
        cache.buffers["0.key"][slot, 0, :n, 0] = 10 * (i + 1) + np.arange(n)  # row i: 10(i+1), 10(i+1)+1, …
    return cache


def test_step_mask_has_length_plus_one_ones_per_row_right_padded():
    mask = filled([3, 1, 5]).step_mask()
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert mask.dtype == np.int64


def test_remove_compacts_survivors_to_a_prefix_keeping_their_tokens():
    cache = filled([3, 2, 4])
    assert cache.remove([0]) == ["r0"]
    assert cache.rows == ["r1", "r2"] and cache.lengths == [2, 4]
    buf = cache.buffers["0.key"][:, 0, :, 0]
    assert buf[0, :2].tolist() == [20, 21] and buf[1, :4].tolist() == [30, 31, 32, 33]
    views = cache.views(0, len(cache))
    assert views["0.key"].shape == (2, 1, 8, 1) and np.shares_memory(views["0.key"], cache.buffers["0.key"])


def test_advance_grows_every_row_and_capacity_is_enforced():
    cache = filled([7, 2])
    cache.advance()
    assert cache.lengths == [8, 3]
    with pytest.raises(InputError, match="capacity of 8"):
        cache.step_mask()
    with pytest.raises(InputError, match="exceeds the KV capacity"):
        filled([9])


def test_slots_run_out_with_a_clear_error():
    cache = filled([1, 1, 1, 1])
    with pytest.raises(InputError, match="all 4 KV slots"):
        cache.claim("r5", 1)
    assert cache.rows == ["r0", "r1", "r2", "r3"]


def test_full_step_mask_is_the_step_mask_at_full_width_kept_in_one_buffer_through_joins_and_leaves():
    cache = filled([3, 1, 5])

    def rows_of(mask: np.ndarray) -> list[list[int]]:
        return [m.tolist() for m in mask]

    full = cache.full_step_mask()
    exact = cache.step_mask()
    assert full.shape == (3, 8) and np.shares_memory(full, cache.mask)
    assert rows_of(full) == [row + [0] * (8 - len(row)) for row in rows_of(exact)]
    cache.advance()
    cache.remove([0])  # r1 and r2 move down one slot each, with their masks
    cache.claim("r3", 2)
    full = cache.full_step_mask()
    assert cache.lengths == [2, 6, 2]
    assert full.sum(axis=1).tolist() == [3, 7, 3]  # each row: what it holds and the step's new token
    assert rows_of(full) == [row + [0] * (8 - len(row)) for row in rows_of(cache.step_mask())]
    # a chunked prefill's row joins with the length it reached
    cache.remove([0, 1, 2])
    cache.reserve("r4", 5)
    cache.pending_length = 5
    cache.commit()
    assert cache.full_step_mask().tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    cache.advance()
    cache.advance()
    cache.advance()
    with pytest.raises(InputError, match="capacity of 8"):
        cache.full_step_mask()


def test_capacity_follows_what_the_rows_can_reach_and_keeps_their_tokens_when_it_grows():
    cache: SlotCache[str] = SlotCache(["0.key"], max_rows=3, kv_heads=2, capacity=4096, head_dim=1)
    assert cache.capacity == 256 and cache.limit == 4096
    a = cache.claim("a", 5, reach=200)
    assert cache.capacity == 256
    cache.buffers["0.key"][a, :, :5, 0] = np.arange(5)
    cache.prepared[(1, 0, 1)] = "a binding of the old buffers"
    b = cache.claim("b", 300, reach=900)  # grows while "a" is held: a copy, and the bindings go
    assert cache.capacity == 1024 and cache.buffers["0.key"].shape == (3, 2, 1024, 1)
    assert cache.buffers["0.key"][a, :, :5, 0].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert cache.mask.shape == (3, 1024) and cache.mask[a].sum() == 5 and cache.mask[b].sum() == 300
    assert cache.prepared == {}
    cache.remove([0, 1])
    cache.claim("c", 10, reach=600)  # empty, and not 4x too large: kept
    assert cache.capacity == 1024
    cache.remove([0])
    cache.claim("d", 10, reach=100)  # empty and 4x too large: shrinks
    assert cache.capacity == 256
    cache.claim("e", 10)  # no reach given: the limit
    assert cache.capacity == 4096


def test_a_row_past_its_reach_makes_room_before_its_step_and_a_pending_row_moves_along():
    cache: SlotCache[str] = SlotCache(["0.key"], max_rows=3, kv_heads=1, capacity=1024, head_dim=1)
    cache.claim("a", 255, reach=255)
    cache.buffers["0.key"][0, 0, :255, 0] = 7
    cache.reserve("p", 100, reach=120)
    cache.buffers["0.key"][1, 0, :40, 0] = 9
    cache.pending_length = 40
    cache.make_room()  # "a" has room for its next token: nothing moves
    assert cache.capacity == 256
    cache.advance()
    cache.make_room()  # its 257th token would not fit
    assert cache.capacity == 512
    assert (cache.buffers["0.key"][0, 0, :256, 0] == [7] * 255 + [0]).all()
    assert (cache.buffers["0.key"][1, 0, :40, 0] == 9).all()
    assert cache.full_step_mask().sum() == 257
    with pytest.raises(InputError, match="exceeds the KV capacity of 1024"):
        SlotCache(["0.key"], 1, 1, 1024, 1).claim("x", 1025)
