"""Audio sources: file replay and raw PCM on stdin (the microphone is in ``mic.py``).

Every source yields float32 mono blocks at 16 kHz. File replay can be paced in real time (what a
microphone would deliver, so latency figures mean something) or unpaced (as fast as the consumer
takes it). Stdin takes headerless PCM (``s16le``, ``s32le`` or ``f32le``) at any rate and channel
count, e.g. ``arecord -f S16_LE -r 16000 -c 1 -t raw | edge-agent listen --stdin``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

import numpy as np

from ..errors import InputError
from . import TARGET_RATE
from .resample import Resampler
from .wav import AudioInfo, read_audio, to_mono

log = logging.getLogger(__name__)

PcmFormat = Literal["s16le", "s32le", "f32le"]
_DTYPES = {"s16le": ("<i2", 32768.0), "s32le": ("<i4", 2147483648.0), "f32le": ("<f4", 1.0)}


class AudioSource(Protocol):
    """Where audio comes from (file, stdin, microphone): float32 mono blocks at ``rate``."""

    rate: int

    def blocks(self) -> Iterator[np.ndarray]:
        """float32 mono blocks at ``rate`` until the source ends (or forever, for a microphone)."""
        ...

    def close(self) -> None: ...


class FileSource:
    """A WAV/FLAC file replayed in ``block_ms`` blocks, paced in real time or not."""

    def __init__(
        self,
        path: str | Path,
        block_ms: int = 20,
        paced: bool = True,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if block_ms <= 0:
            raise InputError(f"block_ms must be positive, got {block_ms}")
        self.path, self.paced, self.rate = Path(path), paced, TARGET_RATE
        self.samples, self.info = read_audio(path, TARGET_RATE)  # validates now: errors before any streaming
        self.block = self.rate * block_ms // 1000
        self._clock, self._sleep = clock, sleep
        self._closed = False

    @property
    def duration_s(self) -> float:
        return self.samples.size / self.rate

    def blocks(self) -> Iterator[np.ndarray]:
        start = self._clock()
        for offset in range(0, self.samples.size, self.block):
            if self._closed:
                return
            block = self.samples[offset : offset + self.block]
            if self.paced:
                # A microphone delivers a block once it has been spoken: wait for its end.
                due = start + (offset + block.size) / self.rate
                delay = due - self._clock()
                if delay > 0:
                    self._sleep(delay)
            yield block

    def close(self) -> None:
        self._closed = True


class StdinSource:
    """Headerless PCM from a binary stream (stdin by default)."""

    def __init__(
        self,
        stream: BinaryIO | None = None,
        fmt: PcmFormat = "s16le",
        rate: int = TARGET_RATE,
        channels: int = 1,
        block_ms: int = 20,
    ) -> None:
        if fmt not in _DTYPES:
            raise InputError(f"unknown PCM format {fmt!r}; choose one of {', '.join(_DTYPES)}")
        if rate < 1000 or channels < 1:
            raise InputError(f"invalid PCM stream: rate {rate} Hz, {channels} channels")
        self.stream = stream if stream is not None else sys.stdin.buffer
        self.fmt, self.in_rate, self.channels, self.rate = fmt, rate, channels, TARGET_RATE
        dtype, self._scale = _DTYPES[fmt]
        self._dtype = np.dtype(dtype)
        self._frame_bytes = self._dtype.itemsize * channels
        self._read_bytes = max(1, rate * block_ms // 1000) * self._frame_bytes
        self._resampler = Resampler(rate, TARGET_RATE)
        self.dropped_bytes = 0  # an incomplete last frame
        self._closed = False

    def blocks(self) -> Iterator[np.ndarray]:
        rest = b""
        while not self._closed:
            chunk = self.stream.read(self._read_bytes)
            if not chunk:
                break
            data = rest + chunk
            usable = len(data) - len(data) % self._frame_bytes
            rest = data[usable:]
            if usable:
                yield self._convert(data[:usable])
        if rest:
            self.dropped_bytes = len(rest)
            log.warning("stdin ended inside a sample frame: %d trailing bytes ignored", len(rest))
        tail = self._resampler.flush()
        if tail.size:
            yield tail

    def _convert(self, raw: bytes) -> np.ndarray:
        x = np.frombuffer(raw, dtype=self._dtype).astype(np.float32) / self._scale
        return self._resampler.push(to_mono(x.reshape(-1, self.channels)))

    def close(self) -> None:
        self._closed = True


def describe(info: AudioInfo) -> str:
    return f"{info.path}: {info.duration_s:.2f} s, {info.sample_rate} Hz, {info.channels} ch, {info.subtype}"
