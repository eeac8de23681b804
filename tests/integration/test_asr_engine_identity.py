"""ASR observations carry the tier's engine identity (``model:<sha256 of the folder>``), as LLM ones do,
so every ASR series in a telemetry window says which model produced it."""

from __future__ import annotations

from edge_agent.config import Settings
from edge_agent.engines.cache import hash_model
from edge_agent.models.catalog import resolve_model
from edge_agent.serving.asr.tiers import open_speech
from tests.speech import require_tools, speech_wav


def test_asr_observation_engine_is_the_model_folder_hash(tmp_path):
    require_tools()
    settings = Settings.model_validate(
        {
            "models": {"asr": [{"name": "ctc", "model": "demo-asr"}], "cache_dir": str(tmp_path / "m")},
            "engines": {"cache_dir": str(tmp_path / "engines")},
        }
    )
    observed = []
    speech = open_speech(settings, observe=observed.append)
    try:
        out = speech.transcribe_bytes(speech_wav("turn on the light").read_bytes(), "a.wav")
        assert out["text"]
    finally:
        speech.stop()
    assert observed, "no final utterance observed"
    folder = resolve_model("demo-asr", settings.models.cache_dir).path
    expected = "model:" + hash_model(folder)  # recomputed here without the memo the tier used
    assert {obs.engine for obs in observed} == {expected}
