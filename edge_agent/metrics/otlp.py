"""Validation of an OTLP JSON ExponentialHistogramDataPoint, the wire form of our histograms.

This is the boundary where other programs' bytes come in, so nothing here may crash: anything
malformed raises ValueError whose message starts with ``histogram field 'NAME'`` (or
``histogram:`` for a non-object). Following the proto3 JSON mapping, 64-bit integers may arrive as
decimal strings and fields at their default value (0, empty) may be absent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_WIRE_BUCKETS = 1 << 16  # a payload claiming more buckets is refused, not allocated


@dataclass(frozen=True, slots=True)
class DataPoint:
    """The validated fields; ``count == zero_count + sum(bucket_counts)`` holds."""

    scale: int
    zero_count: int
    zero_threshold: float
    offset: int
    bucket_counts: tuple[int, ...]
    count: int
    sum: float
    min: float | None
    max: float | None


def parse_data_point(data: Any) -> DataPoint:
    if not isinstance(data, Mapping):
        raise ValueError(f"histogram: expected an object, got {type(data).__name__}")
    scale = _wire_int(data, "scale")
    zero_count, count = _wire_int(data, "zeroCount", 0), _wire_int(data, "count", 0)
    offset, counts = _wire_buckets(data.get("positive"), "positive")
    if data.get("negative") is not None and any(_wire_buckets(data["negative"], "negative")[1]):
        raise ValueError("histogram field 'negative': latencies are never negative, expected no negative bucket counts")
    if count != zero_count + sum(counts):
        raise ValueError(
            f"histogram field 'count': {count} != zeroCount + sum(positive.bucketCounts) = {zero_count + sum(counts)}"
        )
    total = _wire_float(data, "sum")
    if count and total is None:
        # OTLP makes sum optional for histograms with negative values; ours has none.
        raise ValueError("histogram field 'sum': missing (required when count > 0)")
    lo, hi = _wire_float(data, "min"), _wire_float(data, "max")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"histogram field 'min': {lo!r} is greater than max {hi!r}")
    return DataPoint(
        scale, zero_count, _wire_float(data, "zeroThreshold") or 0.0, offset, tuple(counts), count, total or 0.0, lo, hi
    )


def _as_int(value: Any, name: str, minimum: int | None = None) -> int:
    # proto3 JSON writes 64-bit integers as strings; some encoders write 3.0 for 3.
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        number = int(value, 10) if isinstance(value, str) else int(value)
        if isinstance(value, float) and number != value:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"histogram field {name!r}: expected an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"histogram field {name!r}: must be >= {minimum}, got {number}")
    return number


def _wire_int(data: Mapping[str, Any], name: str, minimum: int | None = None) -> int:
    value = data.get(name)
    return 0 if value is None else _as_int(value, name, minimum)


def _wire_float(data: Mapping[str, Any], name: str) -> float | None:
    """A finite number >= 0, or None when absent."""
    value = data.get(name)
    if value is None:
        return None
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"histogram field {name!r}: expected a number, got {value!r}") from None
    if not number >= 0.0 or math.isinf(number):
        raise ValueError(f"histogram field {name!r}: expected a finite number >= 0, got {value!r}")
    return number


def _wire_buckets(value: Any, name: str) -> tuple[int, list[int]]:
    if value is None:
        return 0, []
    if not isinstance(value, Mapping):
        raise ValueError(f"histogram field {name!r}: expected an object, got {type(value).__name__}")
    offset = 0 if value.get("offset") is None else _as_int(value["offset"], f"{name}.offset")
    raw = [] if value.get("bucketCounts") is None else value["bucketCounts"]
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"histogram field '{name}.bucketCounts': expected a list, got {type(raw).__name__}")
    if len(raw) > MAX_WIRE_BUCKETS:
        raise ValueError(
            f"histogram field '{name}.bucketCounts': {len(raw)} buckets, more than the {MAX_WIRE_BUCKETS} accepted"
        )
    counts = [_as_int(c, f"{name}.bucketCounts[{k}]", 0) for k, c in enumerate(raw)]
    if counts and not -(1 << 31) <= offset <= (1 << 31) - len(counts):
        raise ValueError(f"histogram field '{name}.offset': {offset} puts bucket indexes outside int32")
    return offset, counts
