"""Sample-rate conversion in numpy: a windowed-sinc polyphase interpolator that streams.

Output sample ``n`` lies at input time ``t = n * down / up`` (``up/down`` = ``rate_out/rate_in``
reduced); it is the dot product of the ``2 * half`` input samples around ``t`` with one of ``up``
precomputed kernel phases. The cut-off is the lower of the two Nyquist frequencies, so
downsampling (48 kHz → 16 kHz) does not alias. ``Resampler.push`` gives exactly the samples the
one-shot ``resample`` gives for the same input, whatever the block sizes: each output is computed
from the same window with the same weights, and nothing depends on where a block ended.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

ZERO_CROSSINGS = 16  # sinc lobes each side at the cut-off: ~-80 dB stop band with the Hann window


@lru_cache(maxsize=16)
def _kernel(up: int, down: int) -> tuple[np.ndarray, int]:
    cutoff = min(1.0, up / down)  # relative to the input Nyquist
    half = math.ceil(ZERO_CROSSINGS / cutoff)
    k = np.arange(-half + 1, half + 1, dtype=np.float64)  # taps relative to floor(t)
    frac = np.arange(up, dtype=np.float64)[:, None] / up
    d = k[None, :] - frac  # distance of each tap from t, in input samples
    w = cutoff * np.sinc(cutoff * d) * np.where(np.abs(d) < half, 0.5 * (1 + np.cos(np.pi * d / half)), 0.0)
    w /= w.sum(axis=1, keepdims=True)  # unity gain at DC for every phase
    return w.astype(np.float32), half


class Resampler:
    """Streaming ``rate_in`` → ``rate_out`` conversion of float32 mono blocks."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        if rate_in <= 0 or rate_out <= 0:
            raise ValueError(f"sample rates must be positive, got {rate_in} → {rate_out}")
        g = math.gcd(rate_in, rate_out)
        self.rate_in, self.rate_out = rate_in, rate_out
        self.up, self.down = rate_out // g, rate_in // g
        self.passthrough = self.up == self.down
        if not self.passthrough:
            self._table, self._half = _kernel(self.up, self.down)
            # The input before the stream starts is silence: half a window of zeros.
            self._buf = np.zeros(self._half, np.float32)
            self._base = -self._half  # absolute input index of _buf[0]
        self._seen = 0  # input samples pushed
        self._made = 0  # output samples produced (the next output index)
        self._flushed = False

    def push(self, block: np.ndarray) -> np.ndarray:
        x = np.asarray(block, dtype=np.float32).reshape(-1)
        if self._flushed:
            raise RuntimeError("resampler already flushed; make a new one for a new stream")
        self._seen += x.size
        if self.passthrough:
            return x
        self._buf = np.concatenate([self._buf, x])
        return self._produce(limit=None)

    def flush(self) -> np.ndarray:
        """The remaining outputs: the stream's end is followed by silence."""
        if self.passthrough or self._flushed:
            self._flushed = True
            return np.zeros(0, np.float32)
        self._flushed = True
        self._buf = np.concatenate([self._buf, np.zeros(self._half, np.float32)])
        total = -(-self._seen * self.up // self.down)  # ceil(seen * up / down) outputs in all
        return self._produce(limit=total)

    def _produce(self, limit: int | None) -> np.ndarray:
        up, down, half = self.up, self.down, self._half
        last = self._base + self._buf.size - 1  # last available absolute input index
        # Output n needs inputs up to floor(n*down/up) + half.
        end = ((last - half + 1) * up + down - 1) // down  # first n whose window is not complete
        if limit is not None:
            end = min(end, limit)
        if end <= self._made:
            return np.zeros(0, np.float32)
        n = np.arange(self._made, end, dtype=np.int64)
        pos = n * down
        centre, phase = pos // up, pos % up
        start = centre - half + 1 - self._base
        windows = self._buf[start[:, None] + np.arange(2 * half)]
        out = np.einsum("ij,ij->i", windows, self._table[phase]).astype(np.float32)
        self._made = end
        # Keep what the next output's window needs.
        next_first = (end * down) // up - half + 1
        drop = max(0, next_first - self._base)
        if drop:
            self._buf = self._buf[drop:]
            self._base += drop
        return out


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """One-shot conversion of a whole signal (the same samples ``Resampler`` streams)."""
    if rate_in == rate_out:
        return np.asarray(samples, dtype=np.float32).reshape(-1)
    r = Resampler(rate_in, rate_out)
    return np.concatenate([r.push(samples), r.flush()])
