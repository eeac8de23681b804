from __future__ import annotations

import json
import threading

from edge_agent.metrics.timing import RequestTiming
from edge_agent.telemetry.publisher import Identity, Publisher
from edge_agent.telemetry.spool import Spool
from edge_agent.telemetry.windows import WindowAccumulator


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class LoopbackLink:
    """A tiny real link: remembers publishes, acks on demand (the broker's role)."""

    prefix = "edge/v1/dev-1"

    def __init__(self) -> None:
        self.connected = threading.Event()
        self.connected.set()
        self.generation = 1
        self.sent: list[tuple[int, str, dict]] = []
        self.acks: list[tuple[int, int]] = []
        self._mid = 0

    def publish(self, topic, payload, qos=1, retain=False, properties=None):
        self._mid += 1
        self.sent.append((self._mid, topic, json.loads(payload)))
        return self._mid

    def drain_acks(self):
        out, self.acks = self.acks, []
        return out

    def ack_all(self, code: int = 0) -> None:
        self.acks += [(mid, code) for mid, _t, _d in self.sent]


def rig(tmp_path, **kw):
    clock, wall = Clock(), Clock(1.7e9)
    link = LoopbackLink()
    spool = Spool(tmp_path / "s.sqlite", wall=wall)
    acc = WindowAccumulator()
    pub = Publisher(
        link,
        spool,
        acc,
        Identity("dev-1", "t", "boot"),
        interval_s=10,
        clock=clock,
        wall=wall,
        clock_synced=lambda: True,
        **kw,
    )
    return pub, link, spool, acc, clock, wall


def test_window_carries_histograms_local_quantiles_throughput_and_timestamps(tmp_path):
    pub, link, spool, acc, clock, wall = rig(tmp_path)
    for k in range(20):
        acc.observe_timing(
            "llm",
            "small",
            "demo-phi3",
            RequestTiming(0.0, 0.01, (0.05 + k * 0.001, 0.06 + k * 0.001), 0.07 + k * 0.001),
        )
    acc.observe_timing("llm", "small", "demo-phi3", RequestTiming(0, 0, (5.0,), 5.0, tags={"warmup"}))
    acc.observe("asr", "ctc", "demo-ctc", {"first_partial_ms": [120.0], "final_ms": [80.0]}, error=True)
    clock.t += 10
    wall.t += 10
    pub.seal_window()
    pub.pump()
    ((mid, topic, doc),) = link.sent
    assert topic == "edge/v1/dev-1/tele/latency" and doc["seq"] == 1 and doc["historical"] is False
    assert doc["window"]["duration_s"] == 10 and doc["clock_synced"] is True and "clock_jump_s" not in doc
    asr, llm = doc["series"]
    assert llm["requests"] == 20 and llm["tokens_out"] == 40 and llm["throughput"]["requests_per_s"] == 2.0
    assert llm["histograms"]["ttft_ms"]["count"] == 20 and llm["local"]["ttft_ms"]["p99"] == 69.0
    assert set(llm["histograms"]) >= {"ttft_ms", "itl_ms", "e2e_ms"}
    assert llm["local"]["ttft_ms"]["aggregatable"] is False and 0 < llm["relative_error"]["ttft_ms"] < 0.01
    assert asr["errors"] == 1 and set(asr["histograms"]) == {"first_partial_ms", "final_ms"}
    link.ack_all()
    pub.pump()
    assert spool.records == 0 and pub.stats["acked"] == 1


def test_spooled_while_offline_then_replayed_rate_limited_as_historical_while_live_flows(tmp_path):
    pub, link, spool, acc, clock, wall = rig(tmp_path, replay_per_s=2.0, replay_burst=2, live_age_s=5)
    link.connected.clear()
    for _ in range(10):  # 100 s outage
        clock.t += 10
        wall.t += 10
        pub.seal_window()
        pub.pump()
    assert link.sent == [] and spool.records == 10
    link.connected.set()
    link.generation += 1
    clock.t += 10
    wall.t += 10
    pub.seal_window()  # seq 11 is live
    pub.pump()
    sent = [(d["seq"], d["historical"]) for _m, _t, d in link.sent]
    assert sent[0] == (11, False)  # live first
    assert sent[1:] == [(1, True), (2, True)]  # then the burst of the backlog, oldest first
    clock.t += 1.0  # 2 per second
    pub.pump()
    assert [(d["seq"], d["historical"]) for _m, _t, d in link.sent[3:]] == [(3, True), (4, True)]
    link.ack_all()
    for _ in range(10):
        clock.t += 1.0
        pub.pump()
        link.ack_all()
    pub.pump()
    assert spool.records == 0
    assert sorted({d["seq"] for _m, _t, d in link.sent}) == list(range(1, 12))


def test_refused_publish_is_retried_then_dropped_and_reported(tmp_path):
    pub, link, spool, acc, clock, wall = rig(tmp_path, reject_backoff_s=1.0)
    spool.max_attempts = 2
    pub.seal_window()
    pub.pump()
    link.ack_all(0x87)
    pub.pump()
    assert spool.records == 1 and pub.stats["rejected"] == 1
    clock.t += 2
    pub.pump()
    link.acks = [(link.sent[-1][0], 0x87)]
    pub.pump()
    assert spool.records == 0
    pub.drain_events()
    pub.pump()
    drop = next(d for _m, t, d in link.sent if t.endswith("evt/spool_drop"))
    assert drop["data"]["reason"] == "rejected" and drop["data"]["seq_ranges"] == [[1, 1]]


def test_wall_clock_jump_is_flagged_without_disturbing_seq_or_duration(tmp_path):
    pub, link, spool, acc, clock, wall = rig(tmp_path)
    clock.t += 10
    wall.t -= 3600  # NTP stepped the clock back an hour
    pub.seal_window()
    clock.t += 10
    wall.t += 10
    pub.seal_window()
    pub.drain_events()
    pub.pump()
    docs = [d for _m, t, d in link.sent if t.endswith("tele/latency")]
    assert [d["seq"] for d in docs] == [1, 2]
    assert docs[0]["clock_jump_s"] == -3610 and docs[0]["window"]["duration_s"] == 10
    assert "clock_jump_s" not in docs[1]
    (jump,) = [d for _m, t, d in link.sent if t.endswith("evt/clock_jump")]
    assert jump["data"]["jump_s"] == -3610


def test_accumulator_is_bounded(tmp_path):
    acc = WindowAccumulator(max_series=2, max_local_samples=100)
    for k in range(5):
        acc.observe("llm", f"t{k}", "m", {"ttft_ms": [1.0]})
    for _ in range(1000):
        acc.observe("llm", "t0", "m", {"ttft_ms": [2.0], "bogus_ms": [1.0]})
    acc.observe("llm", "t0", "m", {"ttft_ms": [float("nan"), -1.0]})
    s0, s1 = acc.take()
    assert acc.overflow == 3 and len(s0.samples["ttft_ms"]) == 100 and s0.histograms["ttft_ms"].count == 1001
    assert acc.rejected_samples == 1002
    assert s0.to_series(10).local["ttft_ms"].count == 1001


def test_hot_path_never_waits_for_a_stalled_network_or_disk(tmp_path):
    """observe() only takes the accumulator lock: a publish stuck for seconds cannot delay it."""
    import time

    class StalledLink(LoopbackLink):
        def publish(self, *a, **kw):
            time.sleep(1.0)  # a broker behind a slow link, paho's queue full, a full disk...
            return super().publish(*a, **kw)

    link = StalledLink()
    spool = Spool(tmp_path / "s.sqlite")
    acc = WindowAccumulator()
    pub = Publisher(
        link, spool, acc, Identity("dev-1", "t", "boot"), interval_s=0.05, clock_synced=lambda: True
    ).start()
    try:
        worst = 0.0
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            t0 = time.perf_counter()
            acc.observe("llm", "small", "m", {"ttft_ms": [12.0], "itl_ms": [4.0] * 16}, tokens_out=17)
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.001)
        assert pub.stats["windows"] >= 2 and len(link.sent) >= 1  # a stalled publish delays sealing, not observe()
        assert worst < 0.1, f"observe() took {worst * 1e3:.1f} ms while publishing was stalled"
    finally:
        pub.stop()
