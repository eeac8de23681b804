"""Write tests/unit/data/logmel_reference.npz: log-mel reference values from transformers + torch.

Run with the export environment (``.venv-export/bin/python scripts/train_asr/feature_fixture.py``).
The values come from transformers' ``mel_filter_bank`` (slaney scale, slaney norm) and
``torch.stft`` with a periodic Hann window, not from ``edge_agent.audio.features``, so the
unit test compares two independent implementations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers.audio_utils import mel_filter_bank

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "unit" / "data" / "logmel_reference.npz"


def main() -> None:
    sr, n_fft, hop, mels, floor = 16000, 400, 160, 64, 1e-8
    fb = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=mels,
        min_frequency=0.0,
        max_frequency=sr / 2,
        sampling_rate=sr,
        norm="slaney",
        mel_scale="slaney",
    )
    rng = np.random.default_rng(7)
    t = np.arange(int(0.37 * sr)) / sr
    signal = (
        0.3 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 2300 * t) + 0.01 * rng.standard_normal(t.shape)
    ).astype(np.float32)
    spec = torch.stft(
        torch.from_numpy(signal.astype(np.float64)),
        n_fft=n_fft,
        hop_length=hop,
        win_length=n_fft,
        window=torch.hann_window(n_fft, periodic=True, dtype=torch.float64),
        center=False,
        return_complex=True,
    )
    power = (spec.abs() ** 2).numpy().T  # [frames, bins]
    logmel = np.log(np.maximum(power @ fb, floor))
    np.savez_compressed(
        OUT,
        signal=signal,
        filterbank=fb,
        logmel=logmel.astype(np.float32),
        settings=np.array([sr, n_fft, hop, mels], dtype=np.int64),
        log_floor=np.array(floor),
    )
    print(f"wrote {OUT}: filterbank {fb.shape}, log-mel {logmel.shape}")


if __name__ == "__main__":
    main()
