"""Whisper's log-mel spectrogram in numpy, as ``WhisperFeatureExtractor`` computes it.

    pad or cut the waveform to ``n_samples`` (30 s) → STFT (n_fft 400, hop 160, periodic Hann,
    centred frames with reflect padding) → power → slaney mel filterbank (slaney area norm,
    0 .. sr/2) → log10(max(mel, 1e-10)) → drop the last frame → clamp to (max − 8) → (x + 4) / 4

Computed in float64 like the reference extractor, returned as float32 ``[n_mels, 3000]``.
Parameters come from the model's ``preprocessor_config.json``, so a Whisper with 128 mel bins
(large-v3) works the same way.

``feature_padding = "log_mel"`` in that file (what ``models import`` writes for a faster-whisper folder)
pads as faster-whisper does instead: the log-mel of the audio alone (plus one hop of zeros; the clamp's
maximum over those frames, the last two dropped), then zeros up to 3000 frames. The model then sees
what it sees under faster-whisper, whose transcripts it then gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..audio.features import slaney_filterbank


@dataclass(frozen=True, slots=True)
class WhisperFeatureConfig:
    """Whisper's log-mel settings, as its ``preprocessor_config.json`` gives them."""

    feature_size: int = 80
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_samples: int = 480000  # chunk_length (30 s) × sampling_rate
    padding_value: float = 0.0
    feature_padding: str = "audio"  # "audio": the waveform padded with silence; "log_mel": faster-whisper's

    @property
    def nb_max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @classmethod
    def from_folder(cls, folder: str | Path) -> WhisperFeatureConfig:
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        rate = int(data.get("sampling_rate", 16000))
        return cls(
            feature_size=int(data.get("feature_size", 80)),
            sampling_rate=rate,
            n_fft=int(data.get("n_fft", 400)),
            hop_length=int(data.get("hop_length", 160)),
            n_samples=int(data.get("n_samples", int(data.get("chunk_length", 30)) * rate)),
            padding_value=float(data.get("padding_value", 0.0)),
            feature_padding="log_mel" if data.get("feature_padding") == "log_mel" else "audio",
        )


@lru_cache(maxsize=4)
def mel_filters(n_mels: int, n_fft: int, rate: int) -> np.ndarray:
    """Slaney-scale, slaney-normalised triangular filters, float64 ``[n_fft // 2 + 1, n_mels]``."""
    return slaney_filterbank(n_mels, n_fft, rate)


@lru_cache(maxsize=4)
def _hann(n_fft: int) -> np.ndarray:
    return np.hanning(n_fft + 1)[:-1]  # periodic


def pad_or_trim(samples: np.ndarray, cfg: WhisperFeatureConfig) -> np.ndarray:
    x = np.asarray(samples, np.float32).reshape(-1)[: cfg.n_samples]
    if x.size < cfg.n_samples:
        x = np.concatenate([x, np.full(cfg.n_samples - x.size, cfg.padding_value, np.float32)])
    return x


def log_mel_spectrogram(samples: np.ndarray, cfg: WhisperFeatureConfig = WhisperFeatureConfig()) -> np.ndarray:
    """``input_features`` for one waveform (16 kHz float mono), float32 ``[feature_size, nb_max_frames]``."""
    if cfg.feature_padding == "log_mel":
        return _log_mel_then_zeros(samples, cfg)
    x = pad_or_trim(samples, cfg).astype(np.float64)
    used = min(np.asarray(samples).size, cfg.n_samples)
    half = cfg.n_fft // 2
    x = np.pad(x, (half, half), mode="reflect")
    count = 1 + (x.size - cfg.n_fft) // cfg.hop_length
    # Frames that lie wholly in the zero padding have zero power: computing them would change
    # nothing (log10 of the 1e-10 floor) and costs most of the time for a short utterance.
    live = min(count, (used + half) // cfg.hop_length + 1) if used < cfg.n_samples - half else count
    idx = np.arange(cfg.n_fft)[None, :] + cfg.hop_length * np.arange(live)[:, None]
    spec = np.fft.rfft(x[idx] * _hann(cfg.n_fft), axis=-1)
    power = spec.real**2 + spec.imag**2  # [live frames, n_fft/2 + 1]
    mel = np.zeros((count, cfg.feature_size))
    mel[:live] = power @ mel_filters(cfg.feature_size, cfg.n_fft, cfg.sampling_rate)  # [frames, mels]
    log_spec = np.log10(np.maximum(mel, 1e-10)).T[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def _log_mel_then_zeros(samples: np.ndarray, cfg: WhisperFeatureConfig) -> np.ndarray:
    """faster-whisper's features: the audio and one hop of zeros, centred STFT (reflect), the last frame
    dropped, log10, clamp to max − 8, (x + 4) / 4; the last content frame dropped; zeros to 3000 frames."""
    x = np.asarray(samples, np.float64).reshape(-1)[: cfg.n_samples]
    x = np.concatenate([x, np.zeros(cfg.hop_length)])
    half = cfg.n_fft // 2
    x = np.pad(x, (half, half), mode="reflect" if x.size > half else "constant")
    count = 1 + (x.size - cfg.n_fft) // cfg.hop_length
    idx = np.arange(cfg.n_fft)[None, :] + cfg.hop_length * np.arange(count)[:, None]
    spec = np.fft.rfft(x[idx] * _hann(cfg.n_fft), axis=-1)
    power = (spec.real**2 + spec.imag**2)[:-1]  # the STFT's last frame dropped
    mel = power @ mel_filters(cfg.feature_size, cfg.n_fft, cfg.sampling_rate)
    log_spec = np.log10(np.maximum(mel, 1e-10)).T
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    content = ((log_spec + 4.0) / 4.0)[:, : max(0, log_spec.shape[1] - 1)][:, : cfg.nb_max_frames]
    out = np.zeros((cfg.feature_size, cfg.nb_max_frames), np.float32)
    out[:, : content.shape[1]] = content
    return out
