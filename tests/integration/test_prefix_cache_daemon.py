"""The daemon's prefix cache settings reach its schedulers, and /metrics shows each loaded tier's cache."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from edge_agent.config import TierConfig, load_settings
from edge_agent.daemon.app import llm_limits
from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.tiers import Tier, TieredLLM


def test_the_config_sizes_or_turns_off_each_tiers_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = TierConfig(name="t", model="demo-phi3")
    monkeypatch.setenv("EDGE_AGENT_PREFIX_CACHE__MAX_MB", "64")
    on = llm_limits(load_settings(None), tier)
    assert on.prefix_cache_mb == 64
    monkeypatch.setenv("EDGE_AGENT_PREFIX_CACHE__ENABLED", "false")
    assert llm_limits(load_settings(None), tier).prefix_cache_mb == 0


def test_metrics_carry_the_loaded_tiers_prefix_cache(tmp_path: Path) -> None:
    ref = resolve_model("demo-phi3", tmp_path / "models")
    limits = llm_limits(load_settings(None), TierConfig(name="t", model="demo-phi3"))
    served = TieredLLM([Tier("t", lambda: DecoderLM.open(ref, "onnxruntime"), limits, 16, "demo-phi3")]).start()
    metrics = PrometheusMetrics()
    metrics.track_prefix_cache("t", functools.partial(served.prefix_stats, "t"))
    metrics.track_prefix_cache("absent", functools.partial(served.prefix_stats, "absent"))
    try:
        prompt = "the same long instructions " * 20
        for _ in range(2):
            served.submit(prompt, SamplingParams(max_new_tokens=2), raw=True).result(60)
        text = metrics.render().decode()
    finally:
        served.stop(5)
    hit = [line for line in text.splitlines() if "prefix_cache_hit_tokens" in line and 'tier="t"' in line]
    assert hit and float(hit[-1].split()[-1]) > 0  # the second request found the first one's blocks
    assert 'tier="absent"' not in text
