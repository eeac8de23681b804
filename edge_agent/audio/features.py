"""Log-mel features for streaming CTC models, whole or incrementally, with numpy only.

The recipe is the one ``docs/asr-models.md`` states for ``preprocessor_config.json``
(``feature_extractor_type`` ``"LogMelFeatureExtractor"``):

- frames of ``win_length`` samples every ``hop_length`` samples, ``center`` false: frame ``i``
  covers samples ``[i * hop, i * hop + win)``, so a signal of ``n`` samples has
  ``1 + (n - win) // hop`` frames (0 when ``n < win``) and a stream never has to look back
  further than one window;
- a periodic Hann window, zero-padded to ``n_fft``, power spectrum ``|rfft|²``;
- a slaney-scale mel filterbank with slaney (area) normalisation, ``fmin`` .. ``fmax``;
- ``ln(max(mel, log_floor))``, then ``(x - mean) / std`` per mel bin (from the training set).

Everything is computed in float64 and rounded to float32 at the end: the whole-signal and the
incremental paths then give the same float32 values even though BLAS may sum a one-row and a
many-row product in a different order. Training computes its features with this module, so the
model sees at run time exactly what it saw in training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LogMelConfig", "FeatureStream", "log_mel", "mel_filterbank", "num_frames"]

_EXTRACTOR = "LogMelFeatureExtractor"


@dataclass(frozen=True, slots=True)
class LogMelConfig:
    """Feature settings, as stored in a model folder's ``preprocessor_config.json``."""

    sampling_rate: int = 16000
    n_fft: int = 400
    win_length: int = 400
    hop_length: int = 160
    num_mel_bins: int = 64
    fmin: float = 0.0
    fmax: float | None = None  # None = sampling_rate / 2
    log_floor: float = 1e-8
    mean: tuple[float, ...] | None = None  # per mel bin; None = no normalisation
    std: tuple[float, ...] | None = None
    padding_value: float = 0.0

    def __post_init__(self) -> None:
        if self.win_length > self.n_fft:
            raise ValueError(f"win_length {self.win_length} is larger than n_fft {self.n_fft}")
        if self.hop_length <= 0 or self.win_length <= 0 or self.num_mel_bins <= 0:
            raise ValueError("hop_length, win_length and num_mel_bins must be positive")
        if self.log_floor <= 0:
            raise ValueError(f"log_floor must be positive, not {self.log_floor}")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is not None and len(values) != self.num_mel_bins:
                raise ValueError(f"{name} has {len(values)} values for {self.num_mel_bins} mel bins")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError("std values must be positive")

    @classmethod
    def from_preprocessor(cls, source: str | Path | Mapping[str, Any]) -> LogMelConfig:
        """Read ``preprocessor_config.json`` (a path to it, to its folder, or its parsed content)."""
        data: dict[str, Any]
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "preprocessor_config.json"
            data = json.loads(path.read_text())
        kind = data.get("feature_extractor_type", _EXTRACTOR)
        if kind != _EXTRACTOR:
            raise ValueError(f"feature_extractor_type is {kind!r}; this module computes {_EXTRACTOR!r}")
        if data.get("mel_scale", "slaney") != "slaney":
            raise ValueError(f"mel_scale {data['mel_scale']!r} is not supported (only 'slaney')")
        if data.get("center", False):
            raise ValueError("center=true is not supported: streaming needs frames that start at sample 0")
        size = data.get("feature_size", data.get("num_mel_bins"))
        if "num_mel_bins" in data and size != data["num_mel_bins"]:
            raise ValueError(f"feature_size {size} differs from num_mel_bins {data['num_mel_bins']}")
        n_fft = int(data.get("n_fft", 400))
        mean, std = data.get("mean"), data.get("std")
        return cls(
            sampling_rate=int(data.get("sampling_rate", 16000)),
            n_fft=n_fft,
            win_length=int(data.get("win_length", n_fft)),
            hop_length=int(data.get("hop_length", 160)),
            num_mel_bins=int(size if size is not None else 64),
            fmin=float(data.get("fmin", 0.0)),
            fmax=None if data.get("fmax") is None else float(data["fmax"]),
            log_floor=float(data.get("log_floor", 1e-8)),
            mean=None if mean is None else tuple(float(v) for v in mean),
            std=None if std is None else tuple(float(v) for v in std),
            padding_value=float(data.get("padding_value", 0.0)),
        )

    def to_preprocessor(self) -> dict[str, object]:
        """The ``preprocessor_config.json`` content for these settings."""
        return {
            "feature_extractor_type": _EXTRACTOR,
            "sampling_rate": self.sampling_rate,
            "feature_size": self.num_mel_bins,
            "num_mel_bins": self.num_mel_bins,
            "n_fft": self.n_fft,
            "win_length": self.win_length,
            "hop_length": self.hop_length,
            "window": "hann",
            "power": 2.0,
            "mel_scale": "slaney",
            "mel_norm": "slaney",
            "fmin": self.fmin,
            "fmax": self.fmax,  # null = sampling_rate / 2
            "center": False,
            "log": "ln",
            "log_floor": self.log_floor,
            "mean": None if self.mean is None else list(self.mean),
            "std": None if self.std is None else list(self.std),
            "padding_value": self.padding_value,
        }


# Slaney's Auditory Toolbox scale: linear below 1 kHz, logarithmic above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(
        hz >= _MIN_LOG_HZ, _MIN_LOG_MEL + np.log(np.maximum(hz, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOGSTEP, hz / _F_SP
    )


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= _MIN_LOG_MEL, _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel - _MIN_LOG_MEL)), _F_SP * mel)


def mel_filterbank(cfg: LogMelConfig) -> np.ndarray:
    """Slaney mel filterbank with area normalisation, float64 ``[n_fft // 2 + 1, num_mel_bins]``."""
    return slaney_filterbank(cfg.num_mel_bins, cfg.n_fft, cfg.sampling_rate, cfg.fmin, cfg.fmax)


def slaney_filterbank(n_mels: int, n_fft: int, rate: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """librosa's ``mel(htk=False, norm="slaney")``, as Whisper and this contract use it.

    Shape ``[n_fft // 2 + 1, n_mels]``."""
    fmax = fmax if fmax is not None else rate / 2
    fft_hz = np.linspace(0.0, rate / 2, n_fft // 2 + 1)
    mel_points = np.linspace(_hz_to_mel(np.array(fmin)), _hz_to_mel(np.array(fmax)), n_mels + 2)
    edges_hz = _mel_to_hz(mel_points)
    widths = np.diff(edges_hz)
    slopes = edges_hz[None, :] - fft_hz[:, None]  # [bins, mels + 2]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    weights = np.maximum(0.0, np.minimum(down, up))
    return weights * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


def _window(cfg: LogMelConfig) -> np.ndarray:
    n = np.arange(cfg.win_length, dtype=np.float64)
    hann = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / cfg.win_length)  # periodic, as torch.hann_window
    left = (cfg.n_fft - cfg.win_length) // 2
    window = np.zeros(cfg.n_fft, dtype=np.float64)
    window[left : left + cfg.win_length] = hann
    return window


def num_frames(num_samples: int, cfg: LogMelConfig) -> int:
    """Frames a signal of ``num_samples`` samples has (``center`` false)."""
    if num_samples < cfg.n_fft:
        return 0
    return 1 + (num_samples - cfg.n_fft) // cfg.hop_length


class _Kernel:
    """The per-config constants, computed once."""

    __slots__ = ("cfg", "window", "fbank", "mean", "std")

    def __init__(self, cfg: LogMelConfig) -> None:
        self.cfg = cfg
        self.window = _window(cfg)
        self.fbank = mel_filterbank(cfg)
        self.mean = None if cfg.mean is None else np.asarray(cfg.mean, dtype=np.float64)
        self.std = None if cfg.std is None else np.asarray(cfg.std, dtype=np.float64)

    def frames(self, samples: np.ndarray, count: int) -> np.ndarray:
        """Features of the first ``count`` frames of ``samples`` (float64 1-D), float32 ``[count, mels]``."""
        cfg = self.cfg
        if count <= 0:
            return np.zeros((0, cfg.num_mel_bins), dtype=np.float32)
        idx = np.arange(cfg.n_fft)[None, :] + cfg.hop_length * np.arange(count)[:, None]
        spectrum = np.fft.rfft(samples[idx] * self.window, n=cfg.n_fft, axis=-1)
        power = spectrum.real**2 + spectrum.imag**2  # [count, n_fft // 2 + 1]
        feats = np.log(np.maximum(power @ self.fbank, cfg.log_floor))
        if self.mean is not None:
            feats = feats - self.mean
        if self.std is not None:
            feats = feats / self.std
        return feats.astype(np.float32)


_KERNELS: dict[LogMelConfig, _Kernel] = {}


def _kernel(cfg: LogMelConfig) -> _Kernel:
    kernel = _KERNELS.get(cfg)
    if kernel is None:
        if len(_KERNELS) > 16:
            _KERNELS.clear()
        kernel = _KERNELS[cfg] = _Kernel(cfg)
    return kernel


def _as_signal(samples: np.ndarray) -> np.ndarray:
    arr = np.asarray(samples)
    if arr.ndim != 1:
        raise ValueError(f"expected mono samples as a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "f":
        raise ValueError(f"expected float samples in [-1, 1], got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def log_mel(samples: np.ndarray, cfg: LogMelConfig) -> np.ndarray:
    """Normalised log-mel features of a whole signal: float32 ``[frames, num_mel_bins]``."""
    signal = _as_signal(samples)
    return _kernel(cfg).frames(signal, num_frames(signal.shape[0], cfg))


class FeatureStream:
    """Incremental ``log_mel``: push chunks of any size, get the frames they complete.

    The concatenation of everything ``push`` returns equals ``log_mel`` of the concatenated
    samples. At most ``n_fft - hop_length`` samples (plus an unfinished hop) are kept between calls.
    """

    def __init__(self, cfg: LogMelConfig) -> None:
        self.cfg = cfg
        self._kernel = _kernel(cfg)
        self._pending = np.zeros(0, dtype=np.float64)
        self.frames_out = 0  # frames returned so far
        self.samples_in = 0  # samples pushed so far

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Add samples; return the new frames, float32 ``[new_frames, num_mel_bins]`` (maybe 0 rows)."""
        chunk = _as_signal(samples)
        self.samples_in += chunk.shape[0]
        buffer = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        count = num_frames(buffer.shape[0], self.cfg)
        out = self._kernel.frames(buffer, count)
        self._pending = buffer[count * self.cfg.hop_length :].copy()
        self.frames_out += count
        return out

    def reset(self) -> None:
        """Forget everything: the next push starts a new signal."""
        self._pending = np.zeros(0, dtype=np.float64)
        self.frames_out = 0
        self.samples_in = 0
