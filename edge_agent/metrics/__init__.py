"""Latency metrics: per-request timing, rolling SLA windows, mergeable fleet histograms.

See docs/metrics.md for the vocabulary and why percentiles are merged as histograms, never averaged.
"""

from __future__ import annotations

from .histogram import ExponentialHistogram, bucket_index, relative_error
from .timing import LATENCY_METRICS, LatencyStats, RequestTiming, TimingRecorder
from .window import (
    FIRST_AFTER_LOAD,
    SLA_EXCLUDED_TAGS,
    WARMUP,
    MetricSnapshot,
    RollingWindow,
    WindowSnapshot,
    nearest_rank,
)

__all__ = [
    "ExponentialHistogram",
    "bucket_index",
    "relative_error",
    "LATENCY_METRICS",
    "LatencyStats",
    "RequestTiming",
    "TimingRecorder",
    "FIRST_AFTER_LOAD",
    "SLA_EXCLUDED_TAGS",
    "WARMUP",
    "MetricSnapshot",
    "RollingWindow",
    "WindowSnapshot",
    "nearest_rank",
]
