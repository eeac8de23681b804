"""``fleet export`` under a misbehaving device: windows that pass the schema but carry new tier names every
time, 4,096-bucket histograms, a flood of device ids. The exposition stays bounded, honest devices' series
are exactly what they are without the flood, refusals are counted and logged once, idle series expire
(fake clocks, no sleeps)."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.metrics.histogram import ExponentialHistogram
from edge_agent.metrics.window import nearest_rank
from edge_agent.telemetry import fleet_export
from edge_agent.telemetry.fleet_export import FleetCollector, FleetStore, classic_bounds
from edge_agent.telemetry.schema import Histogram, LatencyWindow, Reported, Series, WindowTimes
from edge_agent.telemetry.simulate import SimDevice
from edge_agent.telemetry.wire_latency import Throughput

WALL = 1_700_000_000.0
DEFAULT_MAX_SERIES = 64  # the documented default of --max-series-per-device


def render(store: FleetStore) -> bytes:
    registry = CollectorRegistry()
    registry.register(FleetCollector(store))
    return generate_latest(registry)


def samples(body: bytes) -> list:
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def of_device(body: bytes, device: str) -> list[tuple[str, tuple, float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value) for s in samples(body) if s.labels.get("device") == device
    )


def counter(body: bytes, name: str, **labels: str) -> float:
    found = [s.value for s in samples(body) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def honest_windows(n: int = 4) -> list[bytes]:
    dev = SimDevice("honest", seed=1, requests_per_window=50)
    return [dev.window(wall=WALL + 10 * k, mono=10.0 * k) for k in range(1, n + 1)]


def flood_window(
    seq: int, tiers: int = 64, hist: Histogram | None = None, device: str = "flood", names: str | None = None
) -> bytes:
    """A window the schema accepts, whose every series is a tier name never seen before (unless ``names``)."""
    if hist is None:
        h = ExponentialHistogram()
        h.record_many([10.0 + seq, 20.0, 40.0])
        hist = Histogram.of(h)
    series = [
        Series(
            workload="llm",
            tier=f"{names or f't{seq}'}-{t}",
            model="m",
            requests=3,
            throughput=Throughput(requests_per_s=0.3),
            histograms={"ttft_ms": hist},
        )
        for t in range(tiers)
    ]
    return LatencyWindow(
        device_id=device,
        session=1,
        boot_id="b",
        seq=seq,
        clock_synced=True,
        version="t",
        series=series,
        window=WindowTimes(start_wall=WALL, end_wall=WALL + seq, start_mono=0, end_mono=seq, duration_s=1.0),
    ).to_json()


def test_a_flooding_device_is_held_to_its_series_bound_and_the_honest_device_is_untouched(caplog):
    honest = honest_windows()
    reference = FleetStore(wall=lambda: WALL + 100)  # the honest device alone: what it must look like
    for w in honest:
        reference.ingest("edge/v1/honest/tele/latency", w)
    at_bound = FleetStore(wall=lambda: WALL + 100)  # the flood cut off at exactly the bound by the device itself
    flooded = FleetStore(wall=lambda: WALL + 100)
    caplog.set_level(logging.WARNING, logger="edge_agent.telemetry.fleet_export")
    windows = 20
    for seq in range(1, windows + 1):
        if seq <= len(honest):  # interleaved: the flood starts before the honest device has said everything
            flooded.ingest("edge/v1/honest/tele/latency", honest[seq - 1])
            at_bound.ingest("edge/v1/honest/tele/latency", honest[seq - 1])
        flooded.ingest("edge/v1/flood/tele/latency", flood_window(seq))
    at_bound.ingest("edge/v1/flood/tele/latency", flood_window(1))

    body, ref_body, bound_body = render(flooded), render(reference), render(at_bound)
    # The honest device's every sample is what it is without the flood.
    assert of_device(body, "honest") == of_device(ref_body, "honest") != []
    # The flooding device holds exactly the bound, and 19 more windows of new names cost the scrape nothing.
    buckets = [s for s in samples(body) if s.name == "edge_fleet_latency_ms_bucket" and s.labels["device"] == "flood"]
    assert len(buckets) == DEFAULT_MAX_SERIES * (len(classic_bounds()) + 1)
    assert len(body) <= len(bound_body) + 512  # a few counters with more digits, nothing per window
    # Refusals are counted in the store-wide counter (bounded labels) and against the device.
    refused = windows * 64 - DEFAULT_MAX_SERIES
    assert counter(body, "edge_fleet_refused_total", reason="series_limit") == refused
    assert counter(body, "edge_fleet_device_refused_series_total", device="flood") == refused
    assert not [
        s
        for s in samples(body)
        if s.name == "edge_fleet_device_refused_series_total" and s.labels["device"] == "honest"
    ]
    # Logged once, not once per window.
    over = [r for r in caplog.records if "'flood'" in r.getMessage() and "bound" in r.getMessage()]
    assert len(over) == 1


def test_a_4096_bucket_histogram_is_stored_with_at_most_max_buckets_and_exact_totals():
    wide = ExponentialHistogram(max_size=4096)
    values = [1.0 * 1.001**k for k in range(4096)]  # about one bucket per value at scale 9
    wide.record_many(values)
    assert len(wide.bucket_counts) > 3000
    store = FleetStore()
    store.ingest(
        "edge/v1/wide/tele/latency", flood_window(1, tiers=8, hist=Histogram.of(wide), device="wide", names="w")
    )
    (dev,) = store.devices.values()
    assert len(dev.hists) == 8
    for h in dev.hists.values():
        assert len(h.bucket_counts) <= 160 < len(wide.bucket_counts)
        assert (h.count, h.sum, h.min, h.max) == (wide.count, wide.sum, wide.min, wide.max)
        # Downscaled, not truncated: a quantile is still within the coarser scale's bound of the true one.
        true_p95 = nearest_rank(sorted(values), 95)
        assert abs(h.quantile(0.95) - true_p95) / true_p95 <= h.relative_error
    body = render(store)
    assert counter(body, "edge_fleet_histograms_downscaled_total") == 8
    store.ingest(
        "edge/v1/wide/tele/latency", flood_window(2, tiers=8, hist=Histogram.of(wide), device="wide", names="w")
    )
    assert all(len(h.bucket_counts) <= 160 and h.count == 2 * wide.count for h in store.devices["wide"].hists.values())


def test_max_buckets_is_the_bound_the_flag_sets():
    wide = ExponentialHistogram(max_size=4096)
    wide.record_many([1.0 * 1.001**k for k in range(4096)])
    store = FleetStore(limits=fleet_export.ExportLimits(max_buckets=16))
    store.ingest("edge/v1/w/tele/latency", flood_window(1, tiers=1, hist=Histogram.of(wide), device="w"))
    (h,) = store.devices["w"].hists.values()
    assert len(h.bucket_counts) <= 16 and h.count == 4096


def test_a_flood_of_device_ids_is_refused_past_max_devices_and_logged_at_most_once(caplog):
    store = FleetStore(limits=fleet_export.ExportLimits(max_devices=3), clock=lambda: 0.0)
    honest = honest_windows(2)
    for w in honest:
        store.ingest("edge/v1/honest/tele/latency", w)
    caplog.set_level(logging.WARNING, logger="edge_agent.telemetry.fleet_export")
    for d in range(100):
        store.ingest(f"edge/v1/d{d}/tele/latency", flood_window(1, tiers=1, device=f"d{d}"))
    assert sorted(store.devices) == ["d0", "d1", "honest"]
    body = render(store)
    assert counter(body, "edge_fleet_refused_total", reason="device_limit") == 98
    assert len([r for r in caplog.records if "device_limit" in r.getMessage()]) == 1
    assert store.malformed == 0
    # A device id too long to repeat in every sample is refused whatever the room.
    store2 = FleetStore()
    store2.ingest(f"edge/v1/{'x' * 5000}/tele/latency", flood_window(1, tiers=1, device="x"))
    assert store2.devices == {} and store2.counters()["refused"]["device_id"] == 1


def test_workloads_from_reported_are_bounded():
    store = FleetStore()
    rep = Reported(device_id="r", active_tiers={f"w{k}": "t" * 500 for k in range(1000)})
    store.ingest("edge/v1/r/reported", rep.to_json())
    tiers = [s for s in samples(render(store)) if s.name == "edge_fleet_device_tier"]
    assert len(tiers) == fleet_export.MAX_WORKLOADS
    assert all(len(s.labels["tier"]) <= fleet_export.MAX_LABEL for s in tiers)
    assert store.counters()["refused"]["workload_limit"] == 1000 - fleet_export.MAX_WORKLOADS


def test_idle_series_and_devices_expire_on_a_fake_clock():
    now = [0.0]
    store = FleetStore(limits=fleet_export.ExportLimits(stale_after_s=600, max_devices=2), clock=lambda: now[0])
    store.ingest("edge/v1/flood/tele/latency", flood_window(1, tiers=4))  # tiers t1-0..t1-3
    store.ingest(
        "edge/v1/quiet/state",
        json.dumps(
            {
                "schema": "edge-agent.state/1",
                "device_id": "quiet",
                "state": "offline",
                "session": 1,
                "boot_id": "b",
                "version": "t",
            }
        ).encode(),
    )
    now[0] = 400.0
    store.ingest("edge/v1/flood/tele/latency", flood_window(2, tiers=2))  # tiers t2-0, t2-1
    now[0] = 601.0  # the first window's series and the quiet device are 601 s old; the rest 201 s
    body = render(store)
    assert sorted(store.devices) == ["flood"]
    kept = {s.labels["tier"] for s in samples(body) if s.name == "edge_fleet_latency_ms_count"}
    assert kept == {"t2-0", "t2-1"}
    assert counter(body, "edge_fleet_expired_total", what="series") == 4
    assert counter(body, "edge_fleet_expired_total", what="devices") == 1
    # The room the quiet device held is free again for a new device.
    store.ingest("edge/v1/new/tele/latency", flood_window(1, tiers=1, device="new"))
    assert sorted(store.devices) == ["flood", "new"]
    now[0] = 2000.0
    store.expire()
    assert store.devices == {}


def test_the_bounds_are_flags_of_fleet_export_and_bad_values_are_config_errors():
    from edge_agent.cli import build_parser
    from edge_agent.cli.fleet_export import store_from_args
    from edge_agent.errors import ConfigError

    base = ["fleet", "export", "--broker", "h:1", "--listen", "h:2"]
    store = store_from_args(build_parser().parse_args(base))
    assert store.limits == fleet_export.ExportLimits(
        max_devices=10_000, max_series_per_device=64, max_buckets=160, stale_after_s=3600.0
    )
    flags = ["--max-devices", "5", "--max-series-per-device", "7", "--max-buckets", "20", "--stale-after-s", "0"]
    store = store_from_args(build_parser().parse_args(base + flags))
    assert store.limits == fleet_export.ExportLimits(5, 7, 20, 0.0)
    with pytest.raises(ConfigError):
        store_from_args(build_parser().parse_args([*base, "--max-buckets", "2"]))
