"""Wyoming audio (any rate, sample width and channel count) converted to the recogniser's PCM16 mono.

A Wyoming ``audio-start`` / ``audio-chunk`` says its ``rate``, ``width`` (bytes per sample) and
``channels``; the samples are little-endian signed integers, interleaved (width 1 is signed 8-bit,
as Python's ``audioop`` that the ``wyoming`` library converts with reads it). ``AudioConverter`` checks
the format once (a rate outside ``MIN_RATE``..``MAX_RATE``, a width outside 1–4, channels outside
1..``MAX_CHANNELS``: ``BadAudio``), then per chunk: its byte length must be whole frames (``BadAudio``
naming the length otherwise), channels are averaged, the rate converted by the streaming resampler
(``audio/resample.py``: the output does not depend on how the audio was chunked), and the result
clipped to int16. ``flush`` gives the resampler's tail at the end.

Memory: the resampler computes each output from a window of inputs, and is fed here in pieces small
enough that the windows of one piece stay within ``WINDOW_BUDGET`` bytes, whatever the rate and the
chunk's size; the rate range keeps its filter (built once per rate pair) within a few MiB. One chunk of
the protocol's largest payload (1 MiB) then costs at most about 30 MiB while it is converted.
"""

from __future__ import annotations

import numpy as np

from ....audio.resample import Resampler

MIN_RATE = 8_000  # telephone audio; below, each input sample becomes many outputs (1 Hz: 16,000)
MAX_RATE = 48_000  # the highest rate microphones and satellites send; above, the filter grows with the rate
MAX_CHANNELS = 32
WINDOW_BUDGET = 8 << 20  # bytes of resampling windows (and their indices) per piece fed to the resampler


class BadAudio(ValueError):
    """Audio a client sent that cannot be read as what its header says."""


class AudioConverter:
    """One client's audio format -> PCM16 mono bytes at ``target_rate``."""

    def __init__(self, rate: object, width: object, channels: object, target_rate: int) -> None:
        for name, value in (("rate", rate), ("width", width), ("channels", channels)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadAudio(f"audio {name} must be an integer, not {value!r}")
        assert isinstance(rate, int) and isinstance(width, int) and isinstance(channels, int)
        if not MIN_RATE <= rate <= MAX_RATE:
            raise BadAudio(f"sample rate {rate} Hz is outside {MIN_RATE}..{MAX_RATE}")
        if width not in (1, 2, 3, 4):
            raise BadAudio(f"sample width {width} bytes is not 1, 2, 3 or 4")
        if not 1 <= channels <= MAX_CHANNELS:
            raise BadAudio(f"{channels} channels is outside 1..{MAX_CHANNELS}")
        self.rate, self.width, self.channels, self.target_rate = rate, width, channels, target_rate
        self.frame_bytes = width * channels
        self._resampler = Resampler(rate, target_rate) if rate != target_rate else None
        self._piece = 0  # input samples fed to the resampler at once
        if self._resampler is not None and not self._resampler.passthrough:
            window = 2 * self._resampler._half  # inputs per output
            # per output: its window's samples (float32), their indices (int64) and its kernel row (float32)
            outputs = max(1, WINDOW_BUDGET // (window * 16))
            self._piece = max(1, outputs * self._resampler.down // self._resampler.up)
        self.seconds = 0.0  # audio received, in the client's own time

    def seconds_in(self, data: bytes) -> float:
        """How much audio ``data`` holds, in the client's time (whole frames)."""
        return len(data) // self.frame_bytes / self.rate

    def same_format(self, rate: object, width: object, channels: object) -> bool:
        return (rate, width, channels) == (self.rate, self.width, self.channels)

    def convert(self, data: bytes) -> bytes:
        if len(data) % self.frame_bytes:
            raise BadAudio(
                f"an audio chunk of {len(data)} bytes is not whole frames of {self.frame_bytes} bytes "
                f"({self.width}-byte samples × {self.channels} channel(s))"
            )
        samples = self._decode(data)
        self.seconds += samples.shape[0] / self.rate
        mono = samples.mean(axis=1, dtype=np.float32) if self.channels > 1 else samples[:, 0]
        if self._resampler is not None:
            if self._piece and mono.size > self._piece:
                step = self._piece
                mono = np.concatenate([self._resampler.push(mono[i : i + step]) for i in range(0, mono.size, step)])
            else:
                mono = self._resampler.push(mono)
        return _pcm16(mono)

    def flush(self) -> bytes:
        return _pcm16(self._resampler.flush()) if self._resampler is not None else b""

    def _decode(self, data: bytes) -> np.ndarray:
        """[frames, channels] float32 in [-1, 1)."""
        w = self.width
        if w == 1:
            x = np.frombuffer(data, np.int8).astype(np.float32) / 128.0
        elif w == 2:
            x = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
        elif w == 3:
            b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
            v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            v = np.where(v >= 1 << 23, v - (1 << 24), v)
            x = v.astype(np.float32) / float(1 << 23)
        else:
            x = (np.frombuffer(data, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
        return x.reshape(-1, self.channels)


def _pcm16(x: np.ndarray) -> bytes:
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
