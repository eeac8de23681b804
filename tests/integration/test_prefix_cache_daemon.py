"""The daemon's prefix cache settings reach its schedulers, and /metrics shows each loaded tier's cache; a
bound below one block of a tier's model (a cache that could hold nothing) is refused by check-config, at
start and by the scheduler of the loaded model, with the block size."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from edge_agent.config import LLMTierConfig, load_settings
from edge_agent.daemon.app import Agent
from edge_agent.diagnostics.preflight import config_problems
from edge_agent.errors import ConfigError
from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler
from edge_agent.serving.llm.tiers import Tier, TieredLLM, tier_limits
from edge_agent.systemd import Notifier


def _limits(tier: LLMTierConfig) -> Limits:
    s = load_settings(None)
    return tier_limits(tier, s.batching, s.prefix_cache, s.sla.target_ms)


def test_the_config_sizes_or_turns_off_each_tiers_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = LLMTierConfig(name="t", model="demo-phi3")
    monkeypatch.setenv("EDGE_AGENT_PREFIX_CACHE__MAX_MB", "64")
    on = _limits(tier)
    assert on.prefix_cache_mb == 64
    monkeypatch.setenv("EDGE_AGENT_PREFIX_CACHE__ENABLED", "false")
    assert _limits(tier).prefix_cache_mb == 0


def test_metrics_carry_the_loaded_tiers_prefix_cache(tmp_path: Path) -> None:
    ref = resolve_model("demo-phi3", tmp_path / "models")
    limits = _limits(LLMTierConfig(name="t", model="demo-phi3"))
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


def _config(tmp_path: Path, max_mb: float, model: str = "demo-phi3-small", npu: bool = False) -> Path:
    tier = '[[models.llm]]\nname = "npu"\nmodel = "demo-phi3-small"\nbackend = "openvino"\ndevice = "NPU"\n'
    path = tmp_path / "agent.toml"
    path.write_text(
        "[models]\nasr = []\n"
        + (tier if npu else "")
        + f'[[models.llm]]\nname = "cpu"\nmodel = "{model}"\n'
        + f'[prefix_cache]\nmax_mb = {max_mb}\n[device]\nnpu_emulation = "cpu"\n[api]\nport = 0\n'
    )
    return path


def test_a_bound_below_one_block_is_refused_by_check_config_with_the_block_size(tmp_path: Path) -> None:
    # demo-phi3-small: 2 layers × keys and values × 4 heads × 192 × 4 bytes × 16 tokens = 0.375 MiB a block
    problems = config_problems(_config(tmp_path, 0.3))
    assert [p for p, _ in problems] == ["prefix_cache.max_mb"]
    assert "'cpu'" in problems[0][1] and "0.375 MiB" in problems[0][1]
    assert config_problems(_config(tmp_path, 0.375)) == []  # one block fits
    assert config_problems(_config(tmp_path, 0.3, model="demo-phi3")) == []  # 0.0156 MiB blocks
    # an NPU tier keeps no cache: only the CPU tier below it is named
    problems = config_problems(_config(tmp_path, 0.3, npu=True))
    assert len(problems) == 1 and "'cpu'" in problems[0][1] and "'npu'" not in problems[0][1]


def test_a_bound_below_one_block_is_refused_at_start(tmp_path: Path) -> None:
    path = _config(tmp_path, 0.3)
    agent = Agent(load_settings(str(path)), str(path), notifier=Notifier({}))
    try:
        with pytest.raises(ConfigError, match=r"prefix_cache\.max_mb.*0\.375 MiB"):
            agent.start()
        assert agent.llm is None  # refused before any model was loaded
    finally:
        if agent.llm is not None:
            agent.stop()


def test_a_scheduler_refuses_a_bound_below_one_block_of_its_loaded_model(tmp_path: Path) -> None:
    # the loaded model decides (an engine may keep its KV in another precision than its folder's export)
    lm = DecoderLM.open(resolve_model("demo-phi3-small", tmp_path / "models"), "onnxruntime")
    try:
        with pytest.raises(ConfigError, match=r"0\.375 MiB"):
            LLMScheduler(lm, Limits(prefix_cache_mb=0.3))
        fits = LLMScheduler(lm, Limits(prefix_cache_mb=0.375)).start()  # one block fits
        fits.stop(5)
        assert fits.prefix_cache is not None
    finally:
        lm.close()
