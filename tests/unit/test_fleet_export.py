"""The fleet exporter's store and collector: classic buckets against counted samples, merged quantiles
against pooled raw samples, duplicates, defensive health, and the OTLP push against a local receiver."""

from __future__ import annotations

import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.metrics.histogram import ExponentialHistogram, relative_error
from edge_agent.metrics.window import nearest_rank
from edge_agent.telemetry.fleet_export import FleetCollector, FleetStore, classic_bounds, classic_counts, subscriptions
from edge_agent.telemetry.fleet_otlp import OtlpPusher
from edge_agent.telemetry.simulate import SimDevice


def scrape(store: FleetStore, le_scale: int = 2) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(FleetCollector(store, le_scale=le_scale))
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def fed_store(devices: int = 4, windows: int = 3) -> tuple[FleetStore, list[float]]:
    store, pooled = FleetStore(), []
    for d in range(devices):
        dev = SimDevice(f"dev-{d}", seed=d, requests_per_window=50, keep_samples=True)
        for _ in range(windows):
            store.ingest(f"edge/v1/dev-{d}/tele/latency", dev.window())
        pooled += dev.samples or []
    return store, pooled


def test_classic_buckets_count_exactly_the_samples_at_or_below_each_le():
    rng = random.Random(3)
    values = [rng.lognormvariate(4.0, 0.8) for _ in range(3000)] + [0.0, 0.3, 2.0**14]
    for le_scale in (0, 2, 3):
        hist = ExponentialHistogram()
        hist.record_many(values)
        assert hist.scale >= le_scale  # the exact case the module doc states
        bounds = classic_bounds(le_scale)
        running = 0
        for le, c in zip(bounds, classic_counts(hist, bounds)):
            running += c
            assert running == sum(v <= le for v in values), (le_scale, le)
        assert running + classic_counts(hist, bounds)[-1] == len(values)


def test_a_device_bucket_coarser_than_the_le_grid_is_counted_at_its_upper_end():
    rng = random.Random(4)
    values = [rng.lognormvariate(4.0, 3.0) for _ in range(3000)]
    hist = ExponentialHistogram(max_size=40)
    hist.record_many(values)
    le_scale = hist.scale + 2
    bounds = classic_bounds(le_scale, -12, 30)
    running = 0
    for k, (le, c) in enumerate(zip(bounds, classic_counts(hist, bounds))):
        running += c
        assert running <= sum(v <= le for v in values)  # never early: a sample is counted at or after its le
        if k % 4 == 0:  # an le that is also a boundary of the device's buckets: exact
            assert running == sum(v <= le for v in values)


def test_the_fleet_histogram_is_the_merge_of_every_window_and_duplicates_count_once():
    store, pooled = fed_store()
    payload = SimDevice("dev-0", seed=0, requests_per_window=50).window()
    store.ingest("edge/v1/dev-0/tele/latency", payload)  # seq 1 of dev-0 again: a redelivery
    fleet = store.fleet_histogram("llm", "ttft_ms")
    assert fleet is not None and fleet.count == len(pooled) == 600
    true_p95 = nearest_rank(sorted(pooled), 95)
    assert abs(fleet.quantile(0.95) - true_p95) / true_p95 <= fleet.relative_error
    samples = scrape(store)
    dups = {s.labels["device"]: s.value for s in samples["edge_fleet_device_duplicate_windows_total"]}
    assert dups == {"dev-0": 1.0, "dev-1": 0.0, "dev-2": 0.0, "dev-3": 0.0}
    counts = sum(s.value for s in samples["edge_fleet_latency_ms_count"] if s.labels["metric"] == "ttft_ms")
    assert counts == len(pooled)


def test_a_prometheus_style_quantile_over_the_exposed_buckets_is_within_the_classic_bound():
    store, pooled = fed_store()
    le_scale = 3
    per_le: dict[float, float] = {}
    for s in scrape(store, le_scale)["edge_fleet_latency_ms_bucket"]:
        if s.labels["metric"] == "ttft_ms":
            le = float(s.labels["le"])
            per_le[le] = per_le.get(le, 0.0) + s.value
    # histogram_quantile as Prometheus computes it: linear interpolation inside the bucket holding the rank.
    les = sorted(per_le)
    rank = 0.95 * per_le[math.inf]
    i = next(k for k, le in enumerate(les) if per_le[le] >= rank)
    lo, below = (les[i - 1], per_le[les[i - 1]]) if i else (0.0, 0.0)
    est = lo + (les[i] - lo) * (rank - below) / (per_le[les[i]] - below)
    true_p95 = nearest_rank(sorted(pooled), 95)
    assert abs(est - true_p95) / true_p95 <= 2 ** (2**-le_scale) - 1


def test_health_is_read_defensively_and_never_breaks_the_window():
    store = FleetStore()
    dev = SimDevice("dev-h", seed=1)
    data = json.loads(dev.window())
    data["health"] = {"cpu": {"temp_c": 61.5, "throttled": True}, "power_mode": "MAXN", "bad": float("nan")}
    store.ingest("edge/v1/dev-h/tele/latency", json.dumps(data).encode())
    data2 = json.loads(dev.window())
    data2["health"] = "not an object"
    store.ingest("edge/v1/dev-h/tele/latency", json.dumps(data2).encode())
    store.ingest("edge/v1/dev-h/tele/latency", b"{not json")
    health = {s.labels["name"]: s.value for s in scrape(store)["edge_fleet_device_health"]}
    assert health == {"cpu_temp_c": 61.5, "cpu_throttled": 1.0}
    assert store.devices["dev-h"].seq.received == 2 and store.malformed == 1


def test_state_and_reported_set_online_and_tier_before_any_window():
    store = FleetStore()
    dev = SimDevice("dev-r", seed=3)
    for suffix, payload in dev.retained():
        store.ingest(f"edge/v1/dev-r/{suffix}", payload)
    samples = scrape(store)
    assert [(s.labels["device"], s.value) for s in samples["edge_fleet_device_online"]] == [("dev-r", 1.0)]
    assert [s.labels["tier"] for s in samples["edge_fleet_device_tier"]] == [dev.tier]
    assert "edge_fleet_latency_ms_bucket" not in samples


def test_windows_go_through_a_shared_subscription_and_retained_topics_do_not():
    topics = subscriptions("edge/v1", "g1")
    assert "$share/g1/edge/v1/+/tele/latency" in topics
    assert "edge/v1/+/state" in topics and "edge/v1/+/meta" in topics and "edge/v1/+/reported" in topics
    assert "edge/v1/+/tele/latency" in subscriptions("edge/v1", None)


class _Receiver(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_otlp_push_sends_exponential_histograms_one_to_one():
    store, pooled = fed_store(devices=2)
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        pusher = OtlpPusher(store, f"http://127.0.0.1:{server.server_port}/v1/metrics")
        assert pusher.push()
    finally:
        server.shutdown()
    (body,) = _Receiver.bodies
    (rm,) = body["resourceMetrics"]
    metrics = {m["name"]: m for m in rm["scopeMetrics"][0]["metrics"]}
    eh = metrics["edge.fleet.latency"]["exponentialHistogram"]
    assert eh["aggregationTemporality"] == 2  # cumulative, as an integer enum
    total = 0
    for p in eh["dataPoints"]:
        labels = {a["key"]: a["value"]["stringValue"] for a in p["attributes"]}
        assert set(labels) == {"device", "workload", "tier", "metric"}
        # proto3 JSON: 64-bit integers as decimal strings; counts add up as the data model requires.
        assert all(isinstance(p[k], str) for k in ("count", "zeroCount", "timeUnixNano", "startTimeUnixNano"))
        counts = [int(c) for c in p["positive"]["bucketCounts"]]
        assert int(p["count"]) == int(p["zeroCount"]) + sum(counts)
        assert isinstance(p["scale"], int) and isinstance(p["positive"]["offset"], int)
        if labels["metric"] == "ttft_ms":
            total += int(p["count"])
            # Rebuilt from the wire fields alone, the point answers the same quantile as the store.
            rebuilt = ExponentialHistogram()
            base = 2 ** (2 ** -p["scale"])
            for k, c in enumerate(counts):
                rebuilt.record_many([base ** (p["positive"]["offset"] + k + 0.5)] * c)
            kept = store.devices[labels["device"]].hists[("llm", labels["tier"], "ttft_ms")]
            assert math.isclose(rebuilt.quantile(0.5), kept.quantile(0.5), rel_tol=2 * relative_error(p["scale"]))
    assert total == len(pooled)


def test_an_otlp_url_that_is_not_http_is_refused_with_the_expected_form():
    import pytest

    with pytest.raises(ValueError, match="http://collector:4318/v1/metrics"):
        OtlpPusher(FleetStore(), "ftp://collector/v1/metrics")


def test_the_agents_health_object_becomes_gauges_and_absent_sources_stay_absent():
    store = FleetStore()
    dev = SimDevice("dev-a", seed=5)
    payload = dev.window()
    sent = json.loads(payload)["health"]
    store.ingest("edge/v1/dev-a/tele/latency", payload)
    health = {s.labels["name"]: s.value for s in scrape(store)["edge_fleet_device_health"]}
    assert health["max_temp_c"] == sent["max_temp_c"] == health["temperatures_c_cpu"]
    assert health["process_cpu_percent"] == sent["process_cpu_percent"]
    assert not any(name.startswith(("absent", "rails", "npu", "power_mode")) for name in health)
