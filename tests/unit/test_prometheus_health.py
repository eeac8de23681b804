"""/metrics carries the device health gauges from a snapshot read at each scrape; absent sources flagged."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from edge_agent.metrics.prometheus import PrometheusMetrics


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_health_gauges_follow_the_snapshot_at_each_scrape() -> None:
    docs = [
        {
            "process_rss_bytes": 1000,
            "memory_total_bytes": 8e9,
            "max_temp_c": 71.5,
            "temperatures_c": {"cpu-thermal": 71.5, "gpu-thermal": 60.0},
            "rails_w": {"VDD_IN": 6.0},
            "throttle_counts": {"core": 3},
            "absent": ["rapl", "npu"],
        },
        {
            "process_rss_bytes": 2000,
            "memory_total_bytes": 8e9,
            "max_temp_c": 75.0,
            "temperatures_c": {"cpu-thermal": 75.0},
            "absent": [],
        },
    ]
    m = PrometheusMetrics()
    m.track_health(lambda: docs.pop(0))
    first = samples(m.render())
    assert first[("edge_agent:process_resident_memory_bytes", ())] == 1000
    assert first[("edge_agent:temperature_celsius", (("sensor", "gpu-thermal"),))] == 60.0
    assert first[("edge_agent:rail_power_watts", (("rail", "VDD_IN"),))] == 6.0
    assert first[("edge_agent:cpu_thermal_throttle_total", (("kind", "core"),))] == 3
    assert first[("edge_agent:health_source_absent", (("source", "rapl"),))] == 1
    second = samples(m.render())
    assert second[("edge_agent:process_resident_memory_bytes", ())] == 2000
    assert second[("edge_agent:max_temperature_celsius", ())] == 75.0
    assert second[("edge_agent:health_source_absent", (("source", "rapl"),))] == 0  # present now


def test_a_failing_health_read_never_fails_the_scrape() -> None:
    m = PrometheusMetrics()

    def broken() -> dict:
        raise OSError("sysfs went away")

    m.track_health(broken)
    assert b"edge_agent:time_to_first_token_seconds" in m.render()
