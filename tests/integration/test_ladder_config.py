"""Each ladder built beside its type from its own config sections (``TieredLLM.from_config``,
``TieredSpeech.from_config``)."""

from __future__ import annotations

from pathlib import Path

from edge_agent.config import LLMTierConfig, load_settings
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.tiers import TieredLLM


def test_the_llm_ladder_is_built_from_its_own_config_sections(tmp_path: Path) -> None:
    s = load_settings(None).model_copy(
        update={
            "models": load_settings(None).models.model_copy(
                update={
                    "llm": [
                        LLMTierConfig(name="big", model="demo-phi3", max_new_tokens=64),
                        LLMTierConfig(name="small", model="demo-phi3", max_new_tokens=16, max_batch=8),
                    ],
                    "load_ahead": False,
                }
            ),
            "batching": load_settings(None).batching.model_copy(update={"admission": False}),
        }
    )
    opened: list[str] = []
    ref = resolve_model("demo-phi3", tmp_path / "models")

    def open_model(tier: LLMTierConfig) -> DecoderLM:
        opened.append(tier.name)
        return DecoderLM.open(ref, "onnxruntime")

    ladder = TieredLLM.from_config(
        s.models, s.batching, s.prefix_cache, s.sla.target_ms, open_model, weights=lambda tier: "same"
    )
    big, small = ladder.tiers
    assert (big.name, big.max_new_tokens, big.limits.max_batch) == ("big", 64, 4)  # [batching]'s batch
    assert (small.name, small.max_new_tokens, small.limits.max_batch) == ("small", 16, 8)  # its own
    assert big.weights == small.weights == "same"
    assert not ladder.predictive and not ladder.load_ahead
    assert opened == []  # nothing loads before start
    ladder.start()
    try:
        assert opened == ["big"] and ladder.submit("hi", SamplingParams(max_new_tokens=2)).result(30).token_ids
    finally:
        ladder.stop()


def test_the_speech_ladder_is_built_from_its_own_config_sections() -> None:
    from edge_agent.config import AsrTierConfig, Settings
    from edge_agent.serving.asr.tiers import TieredSpeech

    s = Settings.model_validate(
        {
            "models": {"asr": [{"name": "a", "model": "demo-asr"}, {"name": "b", "model": "demo-asr"}]},
            "asr": {"prompt_words": ["kitchen", "hallway"], "tool_context": False},
            "audio": {"pause_ms": 70},
        }
    )
    asked: list[str] = []

    def open_tier(tier: AsrTierConfig):
        asked.append(tier.name)
        raise AssertionError("nothing opens before start")

    speech = TieredSpeech.from_config(s.models, s.audio, s.batching, s.asr, 250.0, open_tier)
    assert [t.name for t in speech.tiers] == ["a", "b"] and asked == []
    assert speech.prompt_words == ("kitchen", "hallway") and speech.tool_context is False
    assert speech.pause_ms == 70  # replies ahead on a pause ([audio] prefill_ahead and respond_ahead: on)
    assert all(t.engine() is None for t in speech.tiers)  # no identity before a tier opens
