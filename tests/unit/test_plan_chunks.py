"""Chunked prefill's pure pieces: the per-turn token plan and the KV slot a part-way prompt holds."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.models.kv_slots import SlotCache
from edge_agent.serving.llm.prefill import plan_chunks


@pytest.mark.parametrize(
    "remaining, budget, decoding, expected",
    [
        ([], 256, 2, []),  # nothing prefilling
        ([1000], 256, 2, [256]),  # a long prompt: one budget's worth this turn
        ([100], 256, 2, [100]),  # a short one fits whole
        ([100, 50, 600], 256, 2, [100, 50, 106]),  # oldest first; the budget runs out inside the third
        ([100, 156, 40], 256, 2, [100, 156]),  # the budget ends exactly at a prompt's end: the next waits
        ([600, 10], 256, 2, [256]),  # a part-way prompt holds back younger ones (one slot to spare)
        ([44, 10], 256, 3, [44, 10]),  # the last chunk of a long prompt, then a short one
        ([1000, 10], 0, 2, [1000, 10]),  # budget 0: off, every prompt whole (today's behaviour)
        ([1000, 10], 256, 0, [1000, 10]),  # nothing decoding: nobody to keep waiting, whole prompts
        ([3], 1, 1, [1]),  # a budget of one token
    ],
)
def test_plan_chunks(remaining, budget, decoding, expected):
    counts = plan_chunks(remaining, budget, decoding)
    assert counts == expected
    assert all(0 < n <= r for n, r in zip(counts, remaining))
    if budget and decoding:
        assert sum(counts) <= budget
        assert all(n == r for n, r in zip(counts[:-1], remaining))  # only the last can stop part-way


@pytest.mark.parametrize(
    "remaining, budget, decoding, expected",
    [
        ([], 256, 2, []),
        ([100, 50, 600], 256, 2, [100]),  # one prompt per turn: a decode step before the next one
        ([1000, 10], 256, 2, [256]),  # a long one still goes a budget at a time
        ([1000, 10], 0, 2, [1000]),  # chunking off: the oldest whole
        ([1000, 10], 256, 0, [1000]),  # nothing decoding: whole, but still one per turn
    ],
)
def test_one_prompt_per_turn_unless_together(remaining, budget, decoding, expected):
    assert plan_chunks(remaining, budget, decoding, together=False) == expected


def _cache(rows: int = 3) -> SlotCache:
    return SlotCache(["0.key"], rows, kv_heads=1, capacity=8, head_dim=1)


def _fill(cache: SlotCache, slot: int, values: list[float]) -> None:
    cache.buffers["0.key"][slot, 0, : len(values), 0] = values


def test_a_reserved_slot_is_outside_the_active_rows_until_commit_and_moves_when_rows_leave():
    cache = _cache()
    cache.claim("a", 2)
    _fill(cache, 0, [1, 1])
    cache.claim("b", 3)
    _fill(cache, 1, [2, 2, 2])
    slot = cache.reserve("p", 5)
    assert slot == 2 and len(cache) == 2 and cache.pending == "p"
    _fill(cache, slot, [7, 7, 7])
    cache.pending_length = 3
    with pytest.raises(InputError, match="KV slots are in use"):
        cache.claim("c", 1)  # the reserved slot counts against max_rows
    assert cache.remove([0]) == ["a"]
    buf = cache.buffers["0.key"][:, 0, :, 0]
    np.testing.assert_array_equal(buf[0, :3], [2, 2, 2])
    np.testing.assert_array_equal(buf[1, :3], [7, 7, 7])  # the part-way prompt moved down with them
    cache.commit()
    assert cache.rows == ["b", "p"] and cache.lengths == [3, 3] and cache.pending is None


def test_a_released_slot_is_free_again_and_a_reserved_one_refuses_a_claim():
    cache = _cache(2)
    cache.claim("a", 1)
    cache.reserve("p", 4)
    with pytest.raises(InputError, match="chunked prefill holds the next KV slot"):
        cache.max_rows = 3
        cache.claim("b", 1)
    cache.release()
    assert cache.pending is None and cache.claim("b", 1) == 1
    with pytest.raises(InputError, match="exceeds the KV capacity"):
        cache.remove([1])
        cache.reserve("q", 9)
