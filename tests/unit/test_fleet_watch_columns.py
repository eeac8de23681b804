"""``fleet watch`` columns: tier from ``reported`` before any window, ASR P95s, health, stale marking."""

from __future__ import annotations

import json
import random

from edge_agent.metrics.window import nearest_rank
from edge_agent.telemetry.fleet import FleetView, health_columns, render_table
from edge_agent.telemetry.schema import LatencyWindow, Reported, State, WindowTimes
from edge_agent.telemetry.windows import WindowAccumulator


def window(
    device: str, seq: int, llm: list[float], asr: list[float] = (), duration_s: float = 10.0, health: dict | None = None
) -> bytes:
    acc = WindowAccumulator()
    for v in llm:
        acc.observe("llm", "small", "demo-phi3", {"ttft_ms": [v]}, tokens_out=10)
    for v in asr:
        acc.observe("asr", "base", "demo-asr", {"first_partial_ms": [v], "final_ms": [2 * v]})
    series = [s.to_series(duration_s) for s in acc.take()]
    body = json.loads(
        LatencyWindow(
            device_id=device,
            session=1,
            boot_id="b",
            seq=seq,
            clock_synced=True,
            version="t",
            series=series,
            window=WindowTimes(
                start_wall=0, end_wall=duration_s, start_mono=0, end_mono=duration_s, duration_s=duration_s
            ),
        ).to_json()
    )
    if health is not None:
        body["health"] = health
    return json.dumps(body).encode()


def test_tier_comes_from_retained_reported_when_no_window_has_arrived():
    view = FleetView(clock=lambda: 0.0)
    view.ingest("edge/v1/a/state", State(device_id="a", state="online", session=1, boot_id="b", version="t").to_json())
    view.ingest("edge/v1/a/reported", Reported(device_id="a", active_tiers={"llm": "small", "asr": "base"}).to_json())
    row = view.rows()["devices"][0]
    assert row["tier"] == "small" and row["tiers"] == {"llm": "small", "asr": "base"}
    assert row["stale"] is False and row["count"] == 0
    assert " small " in render_table(view.rows())
    view.ingest("edge/v1/a/reported", b"")  # a cleared retained message changes nothing
    assert view.rows()["devices"][0]["tier"] == "small"


def test_asr_columns_are_p95_of_the_merged_asr_histograms():
    rng = random.Random(3)
    view = FleetView(window_s=1e9, clock=lambda: 0.0)
    firsts = []
    for seq in (1, 2, 3):
        samples = [rng.lognormvariate(5.0, 0.4) for _ in range(150)]
        firsts += samples
        view.ingest("edge/v1/a/tele/latency", window("a", seq, [50.0] * 5, samples))
    row = view.rows()["devices"][0]
    ref = nearest_rank(sorted(firsts), 95)
    ref_final = nearest_rank(sorted(2 * v for v in firsts), 95)
    # The bound is the ASR histogram's own (its scale), not the LLM one's.
    err = max(view._merged(view.devices["a"], 0.0, f"asr.{m}").relative_error for m in ("first_partial_ms", "final_ms"))
    assert 0 < err < 0.05
    assert abs(row["asr_first_partial_p95_ms"] - ref) / ref <= err + 1e-3
    assert abs(row["asr_final_p95_ms"] - ref_final) / ref_final <= err + 1e-3
    assert row["count"] == 15  # the LLM columns still count only LLM requests
    # A device without ASR shows "-", not zero.
    view.ingest("edge/v1/b/tele/latency", window("b", 1, [10.0]))
    b = view.rows()["devices"][1]
    assert b["asr_first_partial_p95_ms"] is None and b["asr_final_p95_ms"] is None


def test_health_columns_when_present_and_dash_when_absent():
    view = FleetView(window_s=1e9, clock=lambda: 0.0)
    health = {
        "process_cpu_percent": 37.5,
        "process_rss_bytes": 512 * 2**20,
        "temperatures_c": {"x86_pkg_temp": 61.0, "acpitz": 48.0},
        "absent": ["rapl"],
    }
    view.ingest("edge/v1/a/tele/latency", window("a", 1, [10.0], health=health))
    view.ingest("edge/v1/b/tele/latency", window("b", 1, [10.0]))
    # A health object this schema cannot read shows as absent; the window's latency still counts.
    view.ingest("edge/v1/c/tele/latency", window("c", 1, [10.0], health={"from_the_future": 1}))
    a, b, c = view.rows()["devices"]
    assert (a["cpu_temp_c"], a["rss_mb"], a["cpu_percent"]) == (61.0, 512.0, 37.5)
    assert (b["cpu_temp_c"], b["rss_mb"], b["cpu_percent"]) == (None, None, None)
    assert (c["cpu_temp_c"], c["count"]) == (None, 1)
    assert view.malformed == 0
    lines = render_table(view.rows()).splitlines()
    # the health columns come before REFUSED and PREEMPT (absent here: these windows do not carry them)
    assert lines[1].split()[-5:] == ["61.0", "512.0", "37.5", "-", "-"] and lines[2].split()[-5:] == ["-"] * 5
    # The window's own hottest reading wins when the device reports it.
    assert health_columns({"max_temp_c": 70.2, "temperatures_c": {"a": 40}})["cpu_temp_c"] == 70.2


def test_health_reader_never_raises_on_odd_shapes():
    assert health_columns(None) == {}
    assert health_columns("hot") == {}
    assert health_columns({"process": "x", "temperatures_c": [1, "a", {"temp_c": 70}], "rss_mb": True}) == {
        "cpu_temp_c": 70.0,
        "rss_mb": None,
        "cpu_percent": None,
    }
    assert health_columns({"cpu_temp_c": 55, "rss_mb": 100.04, "cpu_percent": 3})["rss_mb"] == 100.0


def test_a_device_that_went_quiet_is_stale_after_three_intervals():
    now = [0.0]
    view = FleetView(window_s=1e9, clock=lambda: now[0])
    view.ingest("edge/v1/a/state", State(device_id="a", state="online", session=1, boot_id="b", version="t").to_json())
    view.ingest("edge/v1/a/tele/latency", window("a", 1, [10.0], duration_s=5.0))
    now[0] = 15.0  # exactly 3 intervals: still on time
    assert view.rows()["devices"][0]["stale"] is False
    now[0] = 15.1
    snap = view.rows()
    assert snap["devices"][0]["stale"] is True and snap["fleet"]["stale"] == 1
    assert snap["devices"][0]["last_window_age_s"] == 15.1
    table = render_table(snap)
    assert table.splitlines()[1].split()[1] == "stale" and "1 device(s) stale" in table
    view.ingest("edge/v1/a/tele/latency", window("a", 2, [10.0], duration_s=5.0))
    assert view.rows()["devices"][0]["stale"] is False
    # A device that said goodbye is offline, not stale.
    now[0] = 100.0
    view.ingest("edge/v1/a/state", State(device_id="a", state="offline", session=1, boot_id="b", version="t").to_json())
    assert view.rows()["devices"][0]["stale"] is False
