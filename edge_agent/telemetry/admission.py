"""Refusals and preemptions in a window: what the agent's running totals grew by since the last window.

The agent counts every refusal (by workload, reason and class) and every preemption (by workload)
once, in its ``/metrics`` counters (``metrics.prometheus.PrometheusMetrics``: ``refused`` and
``preemptions``). A window carries the growth of those totals since the window before, read as it
is sealed: nothing on the serving path changes, and each refusal lands in exactly one window (the
one during which it was counted), as ``requests`` and ``errors`` do in the series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .wire_latency import Admission, Refusals

log = logging.getLogger(__name__)

MAX_REFUSAL_KEYS = 64  # as Admission.refused's bound: beyond it only the largest counts are carried


@dataclass
class AdmissionTotals:
    """Running totals since the agent started: (workload, reason, class) -> refused, workload -> preempted."""

    refused: dict[tuple[str, str, str], int] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)


def prometheus_totals(metrics: Any) -> AdmissionTotals:
    """The totals held by a ``PrometheusMetrics`` (its ``refused`` and ``preemptions`` counters)."""
    out = AdmissionTotals()
    for family in metrics.refused.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                labels = sample.labels
                key = (labels["workload"], labels["reason"], labels["class"])
                out.refused[key] = out.refused.get(key, 0) + int(sample.value)
    for family in metrics.preemptions.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                workload = sample.labels["workload"]
                out.preempted[workload] = out.preempted.get(workload, 0) + int(sample.value)
    return out


class AdmissionDeltas:
    """``take()`` at each seal: the window's ``Admission`` (what the totals grew by since the last take)."""

    def __init__(self, totals: Callable[[], AdmissionTotals]) -> None:
        self.totals = totals
        self._last = AdmissionTotals()
        self._lock = threading.Lock()

    def take(self) -> Admission:
        with self._lock:
            now = self.totals()
            last, self._last = self._last, now
        refused: dict[tuple[str, str, str], int] = {}
        for key, n in sorted(now.refused.items()):
            grew = n - last.refused.get(key, 0)
            if grew > 0:
                refused[key] = grew
        if len(refused) > MAX_REFUSAL_KEYS:
            log.warning(
                "%d refusal label sets in one window; the %d largest are carried", len(refused), MAX_REFUSAL_KEYS
            )
            refused = dict(sorted(sorted(refused.items(), key=lambda kv: -kv[1])[:MAX_REFUSAL_KEYS]))
        preempted = {w: n - last.preempted.get(w, 0) for w, n in sorted(now.preempted.items())}
        return Admission(
            refused=[Refusals(workload=w, reason=r, class_=c, count=n) for (w, r, c), n in refused.items()],
            preempted={w: n for w, n in preempted.items() if n > 0},
        )
