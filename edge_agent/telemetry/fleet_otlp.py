"""OTLP/HTTP JSON push of the fleet exporter's store (``edge-agent fleet export --otlp URL``).

Plain HTTP POST of an ``ExportMetricsServiceRequest`` in the OTLP JSON encoding (no SDK): the
device histograms go out one-to-one as cumulative ``exponentialHistogram`` data points (scale,
zeroCount, positive offset and bucketCounts are the wire fields the windows already carry), the
per-device state and health as gauges. 64-bit integers are decimal strings and enums integers, as
the OTLP JSON encoding prescribes. A failed push is logged and retried at the next interval; the
data is cumulative, so nothing is lost but freshness.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from .fleet_export import ExportDevice, FleetStore

log = logging.getLogger(__name__)

CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


def _attrs(**labels: str) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in labels.items()]


def _gauge(name: str, unit: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "unit": unit, "gauge": {"dataPoints": points}}


def otlp_request(devices: list[ExportDevice], start_ns: int, now_ns: int) -> dict[str, Any]:
    """The ``ExportMetricsServiceRequest`` JSON object for a store snapshot."""
    hist_points, online, health, tiers = [], [], [], []
    for dev in sorted(devices, key=lambda d: d.device_id):
        for (workload, tier, metric), h in sorted(dev.hists.items()):
            wire = h.to_dict()
            point: dict[str, Any] = {
                "attributes": _attrs(device=dev.device_id, workload=workload, tier=tier, metric=metric),
                "startTimeUnixNano": str(start_ns),
                "timeUnixNano": str(now_ns),
                "count": str(wire["count"]),
                "sum": wire["sum"],
                "scale": wire["scale"],
                "zeroCount": str(wire["zeroCount"]),
                "positive": {
                    "offset": wire["positive"]["offset"],
                    "bucketCounts": [str(c) for c in wire["positive"]["bucketCounts"]],
                },
            }
            if "min" in wire:
                point["min"], point["max"] = wire["min"], wire["max"]
            hist_points.append(point)
        if not math.isnan(dev.online):
            online.append(
                {"attributes": _attrs(device=dev.device_id), "timeUnixNano": str(now_ns), "asDouble": dev.online}
            )
        for workload, tier in sorted(dev.tiers.items()):
            tiers.append(
                {
                    "attributes": _attrs(device=dev.device_id, workload=workload, tier=tier),
                    "timeUnixNano": str(now_ns),
                    "asDouble": 1.0,
                }
            )
        for name, value in sorted(dev.health.items()):
            health.append(
                {"attributes": _attrs(device=dev.device_id, name=name), "timeUnixNano": str(now_ns), "asDouble": value}
            )
    metrics: list[dict[str, Any]] = [
        {
            "name": "edge.fleet.latency",
            "unit": "ms",
            "description": "latency per device, workload, tier and metric, merged from every window",
            "exponentialHistogram": {"aggregationTemporality": CUMULATIVE, "dataPoints": hist_points},
        }
    ]
    for name, unit, points in (
        ("edge.fleet.device.online", "1", online),
        ("edge.fleet.device.tier", "1", tiers),
        ("edge.fleet.device.health", "1", health),
    ):
        if points:
            metrics.append(_gauge(name, unit, points))
    return {
        "resourceMetrics": [
            {
                "resource": {"attributes": _attrs(**{"service.name": "edge-agent-fleet-export"})},
                "scopeMetrics": [{"scope": {"name": "edge_agent.telemetry.fleet_export"}, "metrics": metrics}],
            }
        ]
    }


class OtlpPusher:
    """Pushes ``otlp_request`` of the store to ``url`` every ``interval_s`` on its own thread."""

    def __init__(self, store: FleetStore, url: str, interval_s: float = 10.0, timeout_s: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s) URL such as http://collector:4318/v1/metrics, got {url!r}")
        self.store, self.url, self.interval_s, self.timeout_s = store, url, interval_s, timeout_s
        self.start_ns = time.time_ns()
        self.pushed = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-push", daemon=True)

    def push(self) -> bool:
        body = json.dumps(otlp_request(self.store.snapshot(), self.start_ns, time.time_ns())).encode()
        req = urllib.request.Request(self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
            self.pushed += 1
            return True
        except (urllib.error.URLError, OSError) as exc:
            self.failed += 1
            log.warning("OTLP push to %s failed: %s", self.url, exc)
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()

    def start(self) -> OtlpPusher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1)
        self.push()  # the last state before exit
