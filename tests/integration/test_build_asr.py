"""The ASR build path on the streaming CTC demo model: calibration from streamed chunks, WER gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engines.cache import EngineCache
from edge_agent.engines.datasets import read_audio_manifest
from edge_agent.engines.model_io import AsrProbe
from edge_agent.engines.pipeline import BuildRequest, Heartbeat, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.models.catalog import resolve_model
from edge_agent.systemd import Notifier

ROOT = Path(__file__).resolve().parents[2]
ASR = ROOT / "calibration" / "asr"

pytestmark = pytest.mark.skipif(not (ASR / "calib.jsonl").is_file(), reason="calibration/asr manifests not present")


def make_pipeline(tmp_path: Path, extra: str = "") -> Pipeline:
    text = (ROOT / "engines" / "demo-asr.toml").read_text()
    text = text.replace('method = "minmax"', 'method = "minmax"\n' + extra)
    text = text.replace('"../calibration/asr/', f'"{ASR}/').replace("samples = 100", "samples = 3")
    text = text.replace("samples = 200", "samples = 4").replace("max_wer_delta = 0.02", "max_wer_delta = 0.5")
    path = tmp_path / "demo-asr.toml"
    path.write_text(text)
    return Pipeline(
        load_recipe(path),
        EngineCache(tmp_path / "engines", 1 << 30),
        tmp_path / "models",
        threads=1,
        heartbeat=Heartbeat(enabled=False, notifier=Notifier({})),
    )


def test_calibration_feeds_are_the_streamed_chunks_with_state(tmp_path: Path) -> None:
    probe = AsrProbe(resolve_model("demo-asr", tmp_path))
    feeds = probe.calibration_feeds(read_audio_manifest(ASR / "calib.jsonl", 2))
    assert len(feeds) > 4
    first = feeds[0]
    assert first["features"].shape[:2] == (1, 32) and "state_in.1" in first
    assert any(float(abs(f["state_in.1"]).sum()) > 0 for f in feeds[1:])  # state carried, not reset


@pytest.mark.parametrize("flavour", ["qdq", "dynamic"])
def test_int8_streaming_ctc_is_scored_by_wer(tmp_path: Path, flavour: str) -> None:
    report = make_pipeline(tmp_path).build(BuildRequest("cpu", "int8", flavour=flavour))
    m = report["accuracy"]["metrics"]
    assert m["utterances"] == 4
    assert {"wer", "wer_fp32", "wer_delta", "cer", "text_agreement"} <= set(m)
    assert report["accuracy"]["passed"] == (m["wer_delta"] <= 0.5)
    if flavour == "qdq":
        assert set(report["conversion"]["op_types"]) >= {"Conv", "MatMul"}


@pytest.mark.slow
def test_ignored_types_stay_in_float(tmp_path: Path) -> None:
    pipe = make_pipeline(tmp_path, 'ignored_types = ["Conv"]')
    report = pipe.build(BuildRequest("cpu", "int8"))
    assert "Conv" not in report["conversion"]["op_types"] and "MatMul" in report["conversion"]["op_types"]


@pytest.mark.slow
def test_entropy_calibration_keeps_full_chunks(tmp_path: Path) -> None:
    report = make_pipeline(tmp_path).build(BuildRequest("cpu", "int8", method="entropy"))
    assert report["conversion"]["method"] == "entropy" and report["conversion"]["samples"] > 3


def test_an_asr_tier_is_served_through_the_engine_cache_like_an_llm_tier(tmp_path: Path) -> None:
    from edge_agent.config import AsrTierConfig, EnginesConfig
    from edge_agent.engines.cache import hash_model
    from edge_agent.serving.asr.tiers import cached_opener
    from tests.speech import require_tools, speech_wav

    require_tools()
    report = make_pipeline(tmp_path).build(BuildRequest("cpu", "int8", flavour="dynamic"))
    engines = EnginesConfig(cache_dir=tmp_path / "engines")
    open_tier = cached_opener(engines, tmp_path / "models", threads=1, final_padding_s=0.0)
    engine, identity = open_tier(AsrTierConfig(name="ctc", model="demo-asr", precision="int8"))
    assert identity == f"engine:{report['key']}"  # the built engine, as an LLM tier would serve it
    plain, plain_identity = open_tier(AsrTierConfig(name="ctc", model="demo-asr", precision="fp32"))
    assert plain_identity == "model:" + hash_model(resolve_model("demo-asr", tmp_path / "models").path)
    from edge_agent.audio.wav import read_audio

    samples, _ = read_audio(speech_wav("turn on the light"), engine.sample_rate)
    assert engine.transcribe(samples).text and plain.transcribe(samples).text
