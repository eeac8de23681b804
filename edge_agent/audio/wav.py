"""Reading and validating audio files (WAV, FLAC, anything libsndfile reads) with ``soundfile``.

``read_audio`` returns float32 mono at the requested rate whatever the file holds: 8/16/24/32-bit
integer or float samples, any rate, any channel count (channels are averaged). What cannot be
used is an ``InputError`` that names the file and the problem (not audio, empty, truncated),
never a traceback. Things that can be used but hurt recognition (clipping, silence, a very low
level) are reported in ``AudioInfo.warnings``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import TARGET_RATE
from .resample import resample

log = logging.getLogger(__name__)

CLIP_LEVEL = 0.999  # samples at or above this magnitude count as clipped
CLIP_WARN_FRACTION = 0.001
SILENCE_RMS = 1e-4  # about -80 dBFS: digital silence or a disconnected input


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """What the file held, before conversion."""

    path: str
    sample_rate: int
    channels: int
    subtype: str  # libsndfile's name: PCM_16, PCM_24, PCM_32, PCM_U8, FLOAT, DOUBLE, ...
    frames: int
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def duration_s(self) -> float:
        return self.frames / self.sample_rate if self.sample_rate else 0.0


def _soundfile():
    try:
        import soundfile
    except ImportError as exc:  # pragma: no cover - soundfile is a dependency of the audio extra
        raise InputError("reading audio files needs soundfile: pip install 'edge-agent[audio]'") from exc
    except OSError as exc:  # pragma: no cover - the wheel bundles libsndfile; a system build may not
        raise InputError(f"soundfile cannot load libsndfile ({exc}): apt install libsndfile1") from exc
    return soundfile


def probe(path: str | Path) -> AudioInfo:
    """Header facts of an audio file, or an ``InputError`` saying why it is not usable audio."""
    sf = _soundfile()
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such audio file")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty (0 bytes)")
    try:
        info = sf.info(str(path))
    except Exception as exc:  # soundfile raises LibsndfileError / RuntimeError with libsndfile's text
        raise InputError(f"{path}: not a readable audio file ({_first_line(exc)})") from exc
    if info.samplerate <= 0 or info.channels <= 0:
        raise InputError(f"{path}: invalid header (rate {info.samplerate} Hz, {info.channels} channels)")
    return AudioInfo(str(path), int(info.samplerate), int(info.channels), str(info.subtype), int(info.frames))


def read_audio(path: str | Path, rate: int = TARGET_RATE) -> tuple[np.ndarray, AudioInfo]:
    """The whole file as float32 mono at ``rate`` in [-1, 1], with what the file held."""
    sf = _soundfile()
    info = probe(path)
    if info.frames == 0:
        raise InputError(f"{path}: the file holds no audio (0 frames, header only)")
    try:
        # always_2d: one code path for mono and multi-channel; float32 scales every integer width.
        data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:
        raise InputError(f"{path}: the audio data is unreadable or truncated ({_first_line(exc)})") from exc
    if data.shape[0] == 0:
        raise InputError(f"{path}: the file holds no audio (its data chunk is empty or truncated)")
    if data.shape[0] < info.frames:
        log.warning(
            "%s: header says %d frames, only %d could be read (truncated file)", path, info.frames, data.shape[0]
        )
    mono = to_mono(data)
    warnings = list(check_levels(mono))
    declared = max(info.frames, _wav_declared_frames(Path(path)) or 0)
    if data.shape[0] < declared:
        warnings.append(f"truncated: the header declares {declared} frames, the file holds {data.shape[0]}")
    if info.channels > 1:
        warnings.append(f"{info.channels} channels averaged to mono")
    samples = resample(mono, int(file_rate), rate)
    info = AudioInfo(info.path, info.sample_rate, info.channels, info.subtype, int(data.shape[0]), tuple(warnings))
    for w in warnings:
        log.info("%s: %s", path, w)
    return samples, info


def to_mono(data: np.ndarray) -> np.ndarray:
    """[frames, channels] (or [frames]) → float32 [frames]; non-finite samples become 0, range is clamped."""
    x = np.asarray(data, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]
    elif x.ndim != 1:
        raise InputError(f"audio must be [frames] or [frames, channels], got shape {x.shape}")
    if not np.isfinite(x).all():  # float files can hold NaN/inf; they would poison every feature after them
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(x, -1.0, 1.0).astype(np.float32, copy=False)


def check_levels(samples: np.ndarray) -> list[str]:
    """Warnings about levels that hurt recognition: clipping, silence."""
    out: list[str] = []
    if samples.size == 0:
        return out
    clipped = float(np.mean(np.abs(samples) >= CLIP_LEVEL))
    if clipped >= CLIP_WARN_FRACTION:
        out.append(f"clipping: {clipped:.1%} of samples at full scale")
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))
    if rms < SILENCE_RMS:
        out.append("silence: the signal is below -80 dBFS throughout")
    return out


def write_wav(path: str | Path, samples: np.ndarray, rate: int = TARGET_RATE, subtype: str = "PCM_16") -> Path:
    """Write float samples in [-1, 1] (mono [n] or [n, channels])."""
    sf = _soundfile()
    sf.write(str(path), np.asarray(samples), rate, subtype=subtype)
    return Path(path)


def _wav_declared_frames(path: Path) -> int | None:
    """Frames a RIFF/WAVE header's data chunk declares (libsndfile silently trusts the file size)."""
    import struct

    try:
        with path.open("rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return None
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, block_align = 12, None
    while pos + 8 <= len(head):
        chunk, size = head[pos : pos + 4], struct.unpack("<I", head[pos + 4 : pos + 8])[0]
        if chunk == b"fmt " and pos + 22 <= len(head):
            block_align = struct.unpack("<H", head[pos + 20 : pos + 22])[0]
        elif chunk == b"data":
            return size // block_align if block_align else None
        pos += 8 + size + (size & 1)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
