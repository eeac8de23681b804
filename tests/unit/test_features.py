"""Log-mel features: the whole-signal and incremental paths agree, and match an independent reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_agent.audio.features import FeatureStream, LogMelConfig, log_mel, mel_filterbank, num_frames

FIXTURE = Path(__file__).parent / "data" / "logmel_reference.npz"  # scripts/train_asr/feature_fixture.py


def _signal(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.2 * np.sin(2 * np.pi * 300 * t * (1 + t)) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def _slaney_mel(hz: float) -> float:
    # Closed form of Slaney's scale: 3 mels per 200 Hz below 1 kHz, then 27 mels per factor 6.4.
    return 3 * hz / 200 if hz < 1000 else 15 + 27 * np.log(hz / 1000) / np.log(6.4)


def test_filterbank_matches_transformers_reference() -> None:
    ref = np.load(FIXTURE)
    sr, n_fft, hop, mels = (int(v) for v in ref["settings"])
    cfg = LogMelConfig(sampling_rate=sr, n_fft=n_fft, hop_length=hop, win_length=n_fft, num_mel_bins=mels)
    np.testing.assert_allclose(mel_filterbank(cfg), ref["filterbank"], rtol=0, atol=1e-12)


def test_log_mel_matches_torch_stft_reference() -> None:
    ref = np.load(FIXTURE)
    cfg = LogMelConfig(num_mel_bins=int(ref["settings"][3]), log_floor=float(ref["log_floor"]))
    np.testing.assert_allclose(log_mel(ref["signal"], cfg), ref["logmel"], rtol=0, atol=1e-5)


def test_filterbank_closed_form() -> None:
    cfg = LogMelConfig(num_mel_bins=40, n_fft=512, win_length=400)
    fb = mel_filterbank(cfg)
    assert fb.shape == (257, 40)
    top = _slaney_mel(8000.0)
    edges = [float(v) for v in np.linspace(0, top, 42)]
    hz = [m * 200 / 3 if m < 15 else 1000 * 6.4 ** ((m - 15) / 27) for m in edges]
    freqs = np.linspace(0, 8000, 257)
    for m in (0, 7, 20, 39):
        lo, mid, hi = hz[m], hz[m + 1], hz[m + 2]
        expect = np.clip(np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), 0, None) * 2 / (hi - lo)
        np.testing.assert_allclose(fb[:, m], expect, atol=1e-12)


@pytest.mark.parametrize("chunks", [[1], [7, 13, 401], [159, 161], [1000], [3, 160, 4999, 17]])
def test_stream_equals_whole_signal(chunks: list[int]) -> None:
    cfg = LogMelConfig(mean=tuple(np.linspace(-5, 1, 64)), std=tuple(np.linspace(1, 3, 64)))
    x = _signal(1.234)
    whole = log_mel(x, cfg)
    stream, parts, i, k = FeatureStream(cfg), [], 0, 0
    while i < len(x):
        n = chunks[k % len(chunks)]
        parts.append(stream.push(x[i : i + n]))
        i, k = i + n, k + 1
    got = np.concatenate(parts)
    assert got.dtype == np.float32 and got.shape == whole.shape == (num_frames(len(x), cfg), 64)
    assert np.array_equal(got, whole)
    assert stream.frames_out == whole.shape[0] and stream.samples_in == len(x)


def test_frame_count_and_short_signals() -> None:
    cfg = LogMelConfig()
    assert num_frames(399, cfg) == 0 and num_frames(400, cfg) == 1 and num_frames(560, cfg) == 2
    assert log_mel(np.zeros(100, np.float32), cfg).shape == (0, 64)
    stream = FeatureStream(cfg)
    assert stream.push(np.zeros(399, np.float32)).shape == (0, 64)
    assert stream.push(np.zeros(1, np.float32)).shape == (1, 64)
    stream.reset()
    assert stream.push(np.zeros(399, np.float32)).shape == (0, 64)


def test_silence_hits_the_floor_and_normalisation_applies() -> None:
    cfg = LogMelConfig(num_mel_bins=8, log_floor=1e-6, mean=(1.0,) * 8, std=(2.0,) * 8)
    out = log_mel(np.zeros(800, np.float32), cfg)
    np.testing.assert_allclose(out, (np.log(1e-6) - 1.0) / 2.0, rtol=1e-6)


def test_preprocessor_round_trip(tmp_path: Path) -> None:
    cfg = LogMelConfig(num_mel_bins=4, mean=(0.0, 1.0, 2.0, 3.0), std=(1.0, 1.0, 2.0, 2.0), padding_value=-1.5)
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(cfg.to_preprocessor()))
    assert LogMelConfig.from_preprocessor(path) == cfg
    assert LogMelConfig.from_preprocessor(tmp_path) == cfg
    assert LogMelConfig.from_preprocessor(cfg.to_preprocessor()) == cfg


@pytest.mark.parametrize(
    "change, words",
    [
        ({"feature_extractor_type": "WhisperFeatureExtractor"}, "feature_extractor_type"),
        ({"mel_scale": "htk"}, "mel_scale"),
        ({"center": True}, "center"),
        ({"mean": [0.0, 1.0]}, "mean has 2 values"),
        ({"std": [0.0] * 64}, "positive"),
    ],
)
def test_preprocessor_rejects_what_it_cannot_compute(change: dict, words: str) -> None:
    data = {**LogMelConfig().to_preprocessor(), **change}
    with pytest.raises(ValueError, match=words):
        LogMelConfig.from_preprocessor(data)


def test_rejects_non_mono_or_integer_samples() -> None:
    with pytest.raises(ValueError, match="1-D"):
        log_mel(np.zeros((2, 800), np.float32), LogMelConfig())
    with pytest.raises(ValueError, match="float"):
        FeatureStream(LogMelConfig()).push(np.zeros(800, np.int16))
