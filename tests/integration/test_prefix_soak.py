"""The prefix cache over many requests with rotating system prompts: bounded bytes, memory that stays
flat, and every hit reported to its request."""

from __future__ import annotations

from edge_agent.bench.options import PrefixSoakOptions
from edge_agent.bench.prefix_soak import soak


def _args(tmp_path, **kw) -> PrefixSoakOptions:
    base = dict(
        model="demo-phi3",
        cache_dir=str(tmp_path / "models"),
        requests=300,
        prompts=12,
        system_tokens=200,
        new_tokens=2,
        max_mb=1.0,
        every=50,
        threads=1,
    )
    return PrefixSoakOptions(**{**base, **kw})


def test_a_cache_smaller_than_the_rotation_stays_in_its_bound_and_memory_stays_flat(tmp_path) -> None:
    report = soak(_args(tmp_path), show=False)
    assert report["cache_bytes_max"] <= report["cache_bound_bytes"]
    assert report["evicted_blocks"] > 0  # the rotation did not fit: the bound was exercised
    assert report["hit_tokens"] == report["cached_tokens_reported"]
    rss = report["rss_mb"]
    assert rss["max"] - rss["first"] < 64  # 250 more requests after the first sample: nothing accumulates


def test_a_cache_that_holds_the_rotation_serves_every_repeat_from_it(tmp_path) -> None:
    report = soak(_args(tmp_path, requests=48, max_mb=64.0), show=False)
    assert report["evicted_blocks"] == 0
    # from the second lap on, every whole block of a prompt comes from the cache
    whole = report["prompt_tokens"] // 16 * 16
    repeats = 48 - 12
    assert report["hit_tokens"] >= repeats * (whole - 16)
