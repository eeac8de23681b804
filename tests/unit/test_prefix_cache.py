"""The prefix cache on synthetic KV: block chains, what a hit returns, the memory bound and its LRU
eviction; and how its figures are reported (RequestTiming, the OpenAI usage, /metrics, the config)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.config import load_settings
from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.metrics.timing import RequestTiming, TimingRecorder
from edge_agent.models.prefix_cache import PrefixCache, PrefixStats
from edge_agent.serving.doors.openai.output import usage

B = 4  # tokens per block
NAMES = ("0.key", "0.value")


def kv_of(prompt: list[int]) -> dict[str, np.ndarray]:
    """KV [H=2, tokens, D=3] whose entries name the token and its position: a mix-up shows in the values."""
    pos = np.arange(len(prompt), dtype=np.float32)
    tok = np.asarray(prompt, dtype=np.float32)
    base = (tok * 1000 + pos)[None, :, None] * np.ones((2, 1, 3), np.float32)
    return {name: base + k for k, name in enumerate(NAMES)}


def block_bytes() -> int:
    return 2 * (2 * B * 3 * 4)


def test_a_hit_is_the_longest_run_of_whole_blocks_and_leaves_the_last_token():
    cache = PrefixCache(10**6, B)
    stored = list(range(10, 21))  # 11 tokens: 2 whole blocks are kept
    assert cache.store(stored, kv_of(stored)) == 2
    n, kv = cache.lookup(stored)
    assert n == 8 and kv["0.key"].shape == (1, 2, 8, 3)
    np.testing.assert_array_equal(kv["0.key"][0], kv_of(stored)["0.key"][:, :8])
    np.testing.assert_array_equal(kv["0.value"][0], kv_of(stored)["0.value"][:, :8])
    assert cache.lookup(stored[:8])[0] == 4  # its 8th token must be prefilled: one block
    assert cache.lookup(stored[:9])[0] == 8
    assert cache.lookup([*stored[:4], 99, *stored[5:]])[0] == 4  # a change in block 2 stops the match there
    assert cache.lookup([99, *stored[1:]])[0] == 0  # a block matches only after the blocks before it


@pytest.mark.parametrize("heads", [1, 2])
def test_a_stored_prefix_is_a_copy_not_a_view_of_the_buffer_its_row_goes_on_writing(heads):
    """In-place KV slots hand the cache views of a buffer that the slot's next row overwrites; with one KV
    head (Gemma 3 270M) a block's slice of such a view is contiguous already: it must still be copied."""
    buffer = np.zeros((4, heads, 16, 3), np.float32)  # [rows, H, capacity, D], one per name
    prompt = list(range(30, 38))
    stored = kv_of(prompt)["0.key"][:1].repeat(heads, axis=0)
    buffer[2, :, :8] = stored
    cache = PrefixCache(10**6, B)
    assert cache.store(prompt, {"0.key": buffer[2, :, :8]}) == 2
    buffer[2] = -1.0  # the slot's next row writes its own KV
    n, kv = cache.lookup([*prompt, 99])
    assert n == 8
    np.testing.assert_array_equal(kv["0.key"][0], stored)


def test_the_same_tokens_after_another_start_are_not_a_hit():
    cache = PrefixCache(10**6, B)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    cache.store(a, kv_of(a))
    b = [9, 9, 9, 9, 5, 6, 7, 8, 9]  # block 2 equal, block 1 not: its KV would be another's
    assert cache.lookup(b)[0] == 0


def test_a_hit_is_a_copy_the_cache_keeps_its_own():
    cache = PrefixCache(10**6, B)
    p = list(range(9))
    cache.store(p, kv_of(p))
    _, kv = cache.lookup(p)
    kv["0.key"][:] = -1
    _, again = cache.lookup(p)
    np.testing.assert_array_equal(again["0.key"][0], kv_of(p)["0.key"][:, :8])


def test_storing_a_known_prefix_adds_only_its_new_blocks():
    cache = PrefixCache(10**6, B)
    p = list(range(9))
    assert cache.store(p, kv_of(p)) == 2
    longer = [*p[:8], 50, 51, 52, 53, 54]
    assert cache.store(longer, kv_of(longer)) == 1
    assert len(cache) == 3 and cache.bytes == 3 * block_bytes()
    assert cache.lookup(longer)[0] == 12


def test_bytes_never_exceed_the_bound_and_the_least_recently_used_go_first():
    cache = PrefixCache(5 * block_bytes(), B)
    prompts = [[k * 100 + i for i in range(9)] for k in range(6)]  # 2 blocks each
    for k, p in enumerate(prompts):
        cache.store(p, kv_of(p))
        assert cache.bytes <= cache.max_bytes
        if k == 1:
            assert cache.lookup(prompts[0])[0] == 8  # the first is used again: the second is older now
    stats = cache.stats
    assert stats.evictions == 7 and stats.bytes == 5 * block_bytes()
    assert cache.lookup(prompts[5])[0] == 8 and cache.lookup(prompts[4])[0] == 8
    assert cache.lookup(prompts[1])[0] == 0  # the least recently used went first


def test_a_chain_loses_its_end_first_and_its_start_takes_the_rest_along():
    cache = PrefixCache(3 * block_bytes(), B)
    p = list(range(13))  # 3 blocks: the cache is full
    cache.store(p, kv_of(p))
    q = [77, 78, 79, 80, 81]  # one block: the chain's end goes, its start stays usable
    cache.store(q, kv_of(q))
    assert cache.lookup(p)[0] == 8 and cache.lookup(q)[0] == 4
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0 and cache.lookup(p)[0] == 0


def test_a_prompt_larger_than_the_cache_keeps_what_fits_of_its_start():
    cache = PrefixCache(2 * block_bytes(), B)
    p = list(range(21))
    assert cache.store(p, kv_of(p)) == 2
    assert cache.bytes <= cache.max_bytes and cache.lookup(p)[0] == 8


def test_the_counters_add_up():
    cache = PrefixCache(10**6, B)
    p = list(range(9))
    cache.lookup(p)
    cache.store(p, kv_of(p))
    cache.lookup(p)
    s = cache.stats
    assert (s.lookups, s.lookup_tokens, s.hit_tokens, s.stored_blocks, s.blocks) == (2, 18, 8, 2, 2)


def test_cached_tokens_travel_with_the_timing_and_into_the_usage():
    clock = iter([0.0, 0.1, 0.2, 0.3]).__next__
    rec = TimingRecorder(40, clock=clock)
    rec.mark_scheduled()
    rec.mark_cached(32)
    rec.mark_token()
    timing = rec.finish()
    assert timing.cached_tokens == 32
    assert usage(timing, 5) == {
        "prompt_tokens": 40,
        "completion_tokens": 5,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    with pytest.raises(ValueError, match="cached_tokens"):
        RequestTiming(0.0, 0.0, (0.1,), 0.2, tokens_in=4, cached_tokens=5)


def test_metrics_show_each_tracked_cache():
    metrics = PrometheusMetrics()
    metrics.track_prefix_cache("small", lambda: PrefixStats(lookups=3, hit_tokens=64, evictions=2, bytes=10))
    metrics.track_prefix_cache("npu", lambda: None)  # a tier without a cache shows nothing
    text = metrics.render().decode()
    assert 'edge_agent:prefix_cache_hit_tokens_total{tier="small"} 64.0' in text
    assert 'edge_agent:prefix_cache_lookups_total{tier="small"} 3.0' in text
    assert 'edge_agent:prefix_cache_evicted_blocks_total{tier="small"} 2.0' in text
    assert 'edge_agent:prefix_cache_bytes{tier="small"} 10.0' in text
    assert 'tier="npu"' not in text


def test_the_config_section_is_on_by_default_and_the_environment_turns_it_off(monkeypatch):
    s = load_settings(None).prefix_cache
    assert (s.enabled, s.max_mb, s.block_tokens, s.limit_mb) == (True, 256.0, 16, 256.0)
    monkeypatch.setenv("EDGE_AGENT_PREFIX_CACHE__ENABLED", "false")
    off = load_settings(None).prefix_cache
    assert not off.enabled and off.limit_mb == 0
