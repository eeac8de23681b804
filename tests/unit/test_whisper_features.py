"""Whisper log-mel in numpy against WhisperFeatureExtractor's output stored with demo-whisper."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_agent.models.whisper_features import WhisperFeatureConfig, log_mel_spectrogram, mel_filters, pad_or_trim

DEMO = Path(__file__).resolve().parents[2] / "edge_agent" / "demo_models" / "demo-whisper"


def test_matches_the_reference_feature_extractor():
    ref = np.load(DEMO / "reference.npz")
    cfg = WhisperFeatureConfig.from_folder(DEMO)
    assert (cfg.feature_size, cfg.n_fft, cfg.hop_length, cfg.n_samples) == (80, 400, 160, 480000)
    got = log_mel_spectrogram(ref["waveform"], cfg)
    assert got.shape == (80, 3000) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref["input_features"], atol=1e-4)


def test_pad_or_trim_to_thirty_seconds():
    cfg = WhisperFeatureConfig()
    assert pad_or_trim(np.ones(10), cfg).shape == (480000,)
    long = np.arange(500000, dtype=np.float32)
    np.testing.assert_array_equal(pad_or_trim(long, cfg), long[:480000])


def test_silence_is_the_clamped_floor_and_loud_frames_set_the_range():
    silent = log_mel_spectrogram(np.zeros(16000, np.float32))
    np.testing.assert_allclose(silent, (-10 + 4) / 4)  # log10(1e-10) everywhere
    tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000).astype(np.float32)
    f = log_mel_spectrogram(tone)
    assert f.max() - f.min() <= 2.0 + 1e-6  # clamp to max - 8, then /4


def test_mel_filters_are_slaney_normalised_triangles():
    fb = mel_filters(80, 400, 16000)
    assert fb.shape == (201, 80) and (fb >= 0).all()
    assert (fb.argmax(axis=0)[1:] >= fb.argmax(axis=0)[:-1]).all()  # centres rise with the band index
