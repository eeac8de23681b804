from __future__ import annotations

import json
import random

from edge_agent.metrics.window import nearest_rank
from edge_agent.telemetry.fleet import FleetView, SeqTracker, render_table
from edge_agent.telemetry.schema import LatencyWindow, State, WindowTimes
from edge_agent.telemetry.windows import WindowAccumulator


def window_payload(device: str, seq: int, samples: list[float], historical: bool = False) -> bytes:
    acc = WindowAccumulator()
    for v in samples:
        acc.observe("llm", "small", "demo-phi3", {"ttft_ms": [v]}, tokens_out=10)
    series = [s.to_series(10.0) for s in acc.take()]
    return LatencyWindow(
        device_id=device,
        session=1,
        boot_id="b",
        seq=seq,
        historical=historical,
        clock_synced=True,
        version="t",
        series=series,
        window=WindowTimes(start_wall=0, end_wall=10, start_mono=0, end_mono=10, duration_s=10),
    ).to_json()


def test_merged_fleet_p99_is_within_the_sketch_error_of_pooled_raw_samples():
    rng = random.Random(7)
    view = FleetView(window_s=1e9, clock=lambda: 0.0)
    pooled, device_p99 = [], []
    for d in range(4):
        scale = 3.0 if d == 3 else 1.0  # one degraded device
        mine = []
        for seq in range(1, 6):
            samples = [rng.lognormvariate(4.5, 0.35) * scale for _ in range(200)]
            mine += samples
            view.ingest(f"edge/v1/dev-{d}/tele/latency", window_payload(f"dev-{d}", seq, samples))
        pooled += mine
        device_p99.append(nearest_rank(sorted(mine), 99))
    fleet = view.fleet_histogram()
    true_p99 = nearest_rank(sorted(pooled), 99)
    assert fleet.count == len(pooled) == 4000
    assert abs(fleet.quantile(0.99) - true_p99) / true_p99 <= fleet.relative_error
    # Averaging device percentiles is the mistake the histograms exist to avoid.
    mean_of_p99 = sum(device_p99) / 4
    assert abs(mean_of_p99 - true_p99) / true_p99 > 5 * fleet.relative_error
    rows = view.rows()
    assert rows["fleet"]["count"] == 4000 and abs(rows["fleet"]["p99_ms"] - true_p99) / true_p99 <= fleet.relative_error
    assert rows["fleet"]["requests_per_s"] == 4 * 20.0  # 200 requests per 10 s window, 4 devices
    assert "FLEET (0/4 online)" in render_table(rows)


def test_seq_tracker_gaps_duplicates_and_fill():
    t = SeqTracker()
    assert [t.add(s) for s in (5, 6, 6, 9)] == [True, True, False, True]
    assert t.gaps == 2 and t.duplicates == 1
    assert t.add(7) and t.add(8) and t.gaps == 0
    assert not t.add(8) and t.duplicates == 2


def test_duplicates_are_not_merged_twice_and_historical_fills_gaps_without_skewing_latency():
    view = FleetView(window_s=1e9, clock=lambda: 0.0)
    view.ingest("edge/v1/a/state", State(device_id="a", state="online", session=1, boot_id="b", version="t").to_json())
    view.ingest("edge/v1/a/tele/latency", window_payload("a", 1, [10.0] * 10))
    view.ingest("edge/v1/a/tele/latency", window_payload("a", 1, [10.0] * 10))
    view.ingest("edge/v1/a/tele/latency", window_payload("a", 3, [20.0] * 10))
    row = view.rows()["devices"][0]
    assert (row["state"], row["count"], row["duplicates"], row["gaps"]) == ("online", 20, 1, 1)
    view.ingest("edge/v1/a/tele/latency", window_payload("a", 2, [999.0] * 10, historical=True))
    row = view.rows()["devices"][0]
    assert row["gaps"] == 0 and row["historical"] == 1 and row["count"] == 20


def test_malformed_messages_are_counted_and_described_never_raised():
    view = FleetView()
    view.ingest("edge/v1/a/tele/latency", b"{garbage")
    view.ingest("edge/v1/a/state", json.dumps({"schema": "edge-agent.state/9"}).encode())
    view.ingest("edge/v1/a/state", b"")  # a cleared retained message
    snap = view.rows()
    assert snap["malformed"] == 2 and "edge/v1/a/state" in snap["last_error"]
    assert "malformed messages ignored" in render_table(snap)


def test_windows_older_than_the_horizon_leave_the_table():
    now = [0.0]
    view = FleetView(window_s=60, clock=lambda: now[0])
    view.ingest("edge/v1/a/tele/latency", window_payload("a", 1, [10.0] * 5))
    assert view.rows()["devices"][0]["count"] == 5
    now[0] = 61.0
    assert view.rows()["devices"][0]["count"] == 0
