"""A mergeable base-2 exponential histogram: the OpenTelemetry ExponentialHistogram data point.

Semantics follow the OTel data model exactly, so OTLP receivers and Prometheus native histograms
(schema = scale) read it without translation:

- at scale ``s`` the base is ``2 ** (2 ** -s)``; bucket ``i`` holds values in
  ``(base**i, base**(i+1)]`` (lower-exclusive, upper-inclusive);
- values ``<= zero_threshold`` go to ``zero_count``; ``count = zero_count + sum(bucket_counts)``;
- ``positive.offset`` is the index of ``bucket_counts[0]``;
- when a new value would need more than ``max_size`` buckets the histogram downscales (scale
  decreases, bucket ``i`` becomes ``i >> change``) as the OTel SDK does. Counts, sum, min and max
  stay exact; only resolution is lost.

Quantile estimate: the rank is nearest-rank (``ceil(q * count)``, the same as
``numpy.percentile(..., method="inverted_cdf")``); within the bucket holding that rank the estimate
is the bucket's harmonic midpoint ``2 * lo * hi / (lo + hi)`` (DDSketch's choice), clamped to
``[min, max]``. For any value ``v`` in ``(lo, hi]`` that gives ``|est - v| / v <= (base - 1) / (base + 1)``
(``relative_error``): 4.3 % at scale 3, 2.2 % at scale 4, 1.1 % at scale 5. The geometric midpoint
would give ``sqrt(base) - 1``, slightly worse.

Only non-negative values exist here (latencies in ms), so there are no negative buckets. The wire
form is validated in ``otlp.py``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from .otlp import parse_data_point

MIN_SCALE = -10  # OTel's range: at -10 the whole float range fits in 3 buckets
MAX_SCALE = 20
DEFAULT_MAX_SIZE = 160  # the OTel SDK default
MIN_MAX_SIZE = 3  # enough for any two finite floats at MIN_SCALE, so downscaling always succeeds

# The float log2 fast path is trusted only when log2(m) * 2**s is farther than this (times 2**s)
# from an integer; glibc's log2 is within 1 ulp, so the margin is ~4 orders of magnitude.
_EDGE_MARGIN = 1e-12


def _floor_log2_of_power(mantissa: float, scale: int) -> int:
    """Exactly ``floor(log2(mantissa) * 2**scale)`` for ``1 < mantissa < 2``.

    Equal to ``floor(log2(mantissa ** 2**scale))``: the power is bracketed with integer interval
    arithmetic (truncating after each squaring) until both ends share a binary exponent. The power
    of an odd integer is never a power of two, so the loop always ends.
    """
    numerator, denominator = mantissa.as_integer_ratio()
    shift = (denominator.bit_length() - 1) << scale  # mantissa**2**s = numerator**2**s / 2**shift
    precision = 128
    while True:
        lo = hi = numerator
        exponent = 0
        for _ in range(scale):
            lo, hi, exponent = lo * lo, hi * hi, exponent * 2
            extra = hi.bit_length() - precision
            if extra > 0:
                lo >>= extra
                hi = -((-hi) >> extra)  # ceiling keeps hi an upper bound
                exponent += extra
        floor_lo = lo.bit_length() - 1 + exponent
        if floor_lo == hi.bit_length() - 1 + exponent:
            return floor_lo - shift
        precision *= 2


def bucket_index(value: float, scale: int) -> int:
    """Index of the bucket ``(base**i, base**(i+1)]`` holding ``value > 0`` at ``scale``."""
    frac, exp = math.frexp(value)  # value = frac * 2**exp, frac in [0.5, 1): exact, subnormals too
    if scale <= 0:
        # An exact power of two is the upper (inclusive) boundary of the bucket below it.
        index = exp - 2 if frac == 0.5 else exp - 1
        return index >> -scale
    if frac == 0.5:
        return ((exp - 1) << scale) - 1
    # value = m * 2**(exp-1) with m = 2*frac in (1, 2): index = (exp-1) * 2**s + floor(log2(m) * 2**s).
    # m is not a power of two, so log2(m) * 2**s is irrational and never sits on a boundary;
    # only when the float result is within rounding error of an integer is the exact path needed.
    mantissa = frac * 2.0
    unit = 1 << scale
    x = math.log2(mantissa) * unit
    k = math.floor(x)
    margin = _EDGE_MARGIN * unit
    if x - k < margin or k + 1 - x < margin:
        k = _floor_log2_of_power(mantissa, scale)
    return ((exp - 1) << scale) + k


def lower_boundary(index: int, scale: int) -> float:
    """``base ** index`` (inf / 0.0 where it leaves the float range)."""
    try:
        if scale <= 0:
            return math.ldexp(1.0, index << -scale)
        unit = 1 << scale
        return math.ldexp(2.0 ** ((index & (unit - 1)) / unit), index >> scale)
    except OverflowError:
        return math.inf


def relative_error(scale: int) -> float:
    """Worst-case ``|estimate - true| / true`` of ``quantile`` at ``scale``: ``(base-1)/(base+1)``."""
    inv_base = _inverse_base(scale)
    return (1.0 - inv_base) / (1.0 + inv_base)


def _inverse_base(scale: int) -> float:
    # 1/base rather than base: base overflows at scale -10, its inverse merely underflows to 0.
    if scale <= 0:
        return math.ldexp(1.0, -(1 << -scale))
    return 2.0 ** -(2.0**-scale)


def _rank(count: int, q: float) -> int:
    # Decimal(repr(q)) reads 0.95 as exactly 95/100, so ceil() is not thrown off by binary rounding.
    return max(1, math.ceil(Decimal(repr(float(q))) * count))


class ExponentialHistogram:
    """OTel exponential histogram of non-negative values (milliseconds). Not thread-safe."""

    __slots__ = (
        "max_size",
        "max_scale",
        "zero_threshold",
        "scale",
        "zero_count",
        "count",
        "sum",
        "_min",
        "_max",
        "_bounds_known",
        "_offset",
        "_counts",
    )
    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable as the data model spells it; typeshed wants a method

    def __init__(
        self, max_size: int = DEFAULT_MAX_SIZE, max_scale: int = MAX_SCALE, zero_threshold: float = 0.0
    ) -> None:
        if not isinstance(max_size, int) or max_size < MIN_MAX_SIZE:
            raise ValueError(f"max_size must be an integer >= {MIN_MAX_SIZE}, got {max_size!r}")
        if not isinstance(max_scale, int) or not MIN_SCALE <= max_scale <= MAX_SCALE:
            raise ValueError(f"max_scale must be an integer in [{MIN_SCALE}, {MAX_SCALE}], got {max_scale!r}")
        if not (zero_threshold >= 0.0) or math.isinf(zero_threshold):
            raise ValueError(f"zero_threshold must be a finite number >= 0, got {zero_threshold!r}")
        self.max_size = max_size
        self.max_scale = max_scale
        self.zero_threshold = float(zero_threshold)
        self.scale = max_scale  # the SDK starts fine and downscales as the range grows
        self.zero_count = 0
        self.count = 0
        self.sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        self._bounds_known = True  # False only for a wire histogram that came without min/max
        self._offset = 0
        self._counts: list[int] = []

    @property
    def min(self) -> float | None:
        return self._min if self.count and self._bounds_known else None

    @property
    def max(self) -> float | None:
        return self._max if self.count and self._bounds_known else None

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def bucket_counts(self) -> tuple[int, ...]:
        return tuple(self._counts)

    @property
    def relative_error(self) -> float:
        return relative_error(self.scale)

    def record(self, value_ms: float) -> None:
        if value_ms.__class__ is not float:  # ints and numpy scalars become plain floats for JSON
            if isinstance(value_ms, (str, bool)) or not isinstance(value_ms, numbers.Real):
                raise ValueError(f"latency must be a number of ms, got {value_ms!r}")
            value_ms = float(value_ms)
        # `not >=` also catches NaN; inf would poison sum and has no bucket.
        if not (value_ms >= 0.0) or value_ms == math.inf:
            raise ValueError(f"latency must be a finite number >= 0 ms, got {value_ms!r}")
        if value_ms > self.zero_threshold:
            index = bucket_index(value_ms, self.scale)
            counts = self._counts
            k = index - self._offset
            if counts and 0 <= k < len(counts):
                counts[k] += 1
            else:
                self._add_outside(index, 1)
        else:
            self.zero_count += 1
        self.count += 1
        self.sum += value_ms
        if value_ms < self._min:
            self._min = value_ms
        if value_ms > self._max:
            self._max = value_ms

    def record_many(self, values_ms: Iterable[float]) -> None:
        for value in values_ms:
            self.record(value)

    def _add_outside(self, index: int, n: int) -> None:
        """Add ``n`` to bucket ``index`` (at the current scale) that lies outside the stored range."""
        if not self._counts:
            self._offset, self._counts = index, [n]
            return
        lo = min(self._offset, index)
        hi = max(self._offset + len(self._counts) - 1, index)
        change = _change_to_fit(lo, hi, self.max_size)
        if change:
            self._downscale(change)
            index >>= change
        k = index - self._offset
        if k < 0:
            self._counts[:0] = [0] * -k
            self._offset = index
            k = 0
        elif k >= len(self._counts):
            self._counts.extend([0] * (k - len(self._counts) + 1))
        self._counts[k] += n

    def _downscale(self, change: int) -> None:
        if change <= 0:
            return
        if self.scale - change < MIN_SCALE:
            # Only reachable from wire data with absurd offsets or a tiny max_size in from_dict.
            raise ValueError(
                f"histogram range needs scale {self.scale - change}, below {MIN_SCALE}: "
                f"raise max_size ({self.max_size})"
            )
        if self._counts:
            new_offset = self._offset >> change
            last = (self._offset + len(self._counts) - 1) >> change
            merged = [0] * (last - new_offset + 1)
            for k, c in enumerate(self._counts):
                merged[((self._offset + k) >> change) - new_offset] += c
            self._offset, self._counts = new_offset, merged
        self.scale -= change

    def merge(self, other: ExponentialHistogram) -> None:
        """Add ``other`` into this histogram exactly, at the finer scale both can represent."""
        if other.zero_threshold != self.zero_threshold:
            raise ValueError(
                f"cannot merge histograms with different zero_threshold: "
                f"{self.zero_threshold!r} vs {other.zero_threshold!r}"
            )
        if other.count == 0:
            return
        offset, counts, scale = other._offset, list(other._counts), other.scale  # safe if other is self
        # A histogram with only zeros has no buckets, so its scale must not coarsen ours.
        target = min(self.scale, scale) if counts else self.scale
        if counts:
            o_lo, o_hi = offset >> (scale - target), (offset + len(counts) - 1) >> (scale - target)
            if self._counts:
                shift = self.scale - target
                lo = min(o_lo, self._offset >> shift)
                hi = max(o_hi, (self._offset + len(self._counts) - 1) >> shift)
            else:
                lo, hi = o_lo, o_hi
            target -= _change_to_fit(lo, hi, self.max_size)
        self._downscale(self.scale - target)
        shift = scale - target
        for k, c in enumerate(counts):
            if c:
                index = (offset + k) >> shift
                j = index - self._offset
                if self._counts and 0 <= j < len(self._counts):
                    self._counts[j] += c
                else:
                    self._add_outside(index, c)  # fits: the range was sized above
        self._bounds_known = (self._bounds_known or not self.count) and other._bounds_known
        self.zero_count += other.zero_count
        self.count += other.count
        self.sum += other.sum
        self._min = min(self._min, other._min)
        self._max = max(self._max, other._max)

    def copy(self) -> ExponentialHistogram:
        twin = ExponentialHistogram(self.max_size, self.max_scale, self.zero_threshold)
        for name in ("scale", "zero_count", "count", "sum", "_min", "_max", "_offset", "_bounds_known"):
            setattr(twin, name, getattr(self, name))
        twin._counts = list(self._counts)
        return twin

    def quantile(self, q: float) -> float | None:
        """Nearest-rank ``q``-quantile estimate (``0 <= q <= 1``); None when empty. See module doc.

        A rank in the zero bucket gives 0.0, exact with the default ``zero_threshold`` of 0 (with a
        positive threshold: half of it, and the relative bound does not hold there).
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must be in [0, 1], got {q!r}")
        if self.count == 0:
            return None
        rank = _rank(self.count, q)
        if rank <= self.zero_count:
            estimate = 0.0 if self.zero_threshold == 0.0 else self.zero_threshold / 2
        else:
            seen = self.zero_count
            index = self._offset + len(self._counts) - 1
            for k, c in enumerate(self._counts):
                seen += c
                if seen >= rank:
                    index = self._offset + k
                    break
            lo = lower_boundary(index, self.scale)
            estimate = lo * 2.0 / (1.0 + _inverse_base(self.scale))
        # The true value lies in [min, max]: clamping can only move the estimate closer to it.
        return min(max(estimate, self._min), self._max)

    def to_dict(self) -> dict[str, Any]:
        """OTLP JSON field names (64-bit counts as JSON numbers); min/max omitted when empty."""
        out: dict[str, Any] = {
            "scale": self.scale,
            "zeroCount": self.zero_count,
            "zeroThreshold": self.zero_threshold,
            "positive": {"offset": self._offset, "bucketCounts": list(self._counts)},
            "count": self.count,
            "sum": self.sum,
        }
        if self.count and self._bounds_known:
            out["min"], out["max"] = self._min, self._max
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], max_size: int | None = None) -> ExponentialHistogram:
        """Parse the ``to_dict`` shape, which is also OTLP JSON's: as in proto3 JSON, 64-bit integers
        may be decimal strings and fields at their default (0) may be omitted; ``sum`` is required
        once ``count > 0``. Malformed input raises ValueError naming the field. Without ``max_size``
        every received bucket is kept; a smaller one downscales to fit. Unknown keys are ignored.
        """
        point = parse_data_point(data)
        scale, offset, counts = point.scale, point.offset, list(point.bucket_counts)
        if not MIN_SCALE <= scale <= MAX_SCALE:
            raise ValueError(f"histogram field 'scale': must be in [{MIN_SCALE}, {MAX_SCALE}], got {scale}")
        # Leading/trailing empty buckets carry nothing; trimming keeps one canonical form.
        while counts and counts[-1] == 0:
            counts.pop()
        start = next((k for k, c in enumerate(counts) if c), len(counts))
        offset, counts = offset + start, counts[start:]
        hist = cls(
            max(DEFAULT_MAX_SIZE, len(counts)) if max_size is None else max_size, MAX_SCALE, point.zero_threshold
        )
        hist.scale, hist._offset, hist._counts = scale, offset, counts
        hist._downscale(_change_to_fit(offset, offset + len(counts) - 1, hist.max_size) if counts else 0)
        hist.zero_count, hist.count, hist.sum = point.zero_count, point.count, point.sum
        if point.count:
            if point.min is not None and point.max is not None:
                hist._bounds_known, hist._min, hist._max = True, point.min, point.max
            else:  # unknown bounds stay loose ([0, inf]): quantile clamping is then a no-op
                hist._bounds_known, hist._min, hist._max = False, 0.0, math.inf
        return hist

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExponentialHistogram):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (
            f"ExponentialHistogram(count={self.count}, scale={self.scale}, "
            f"zero_count={self.zero_count}, offset={self._offset}, buckets={len(self._counts)})"
        )


def _change_to_fit(lo: int, hi: int, max_size: int) -> int:
    change = 0
    while (hi >> change) - (lo >> change) + 1 > max_size:
        change += 1
    return change
