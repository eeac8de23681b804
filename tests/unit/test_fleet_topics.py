"""Device topics under a prefix of any length: ``fleet watch`` and ``fleet export`` read the device id after
the configured prefix (one shared parser), and a topic outside it is counted, never a crash."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.cli import build_parser
from edge_agent.cli.fleet import view_from_args
from edge_agent.cli.fleet_export import store_from_args
from edge_agent.telemetry.fleet import split_device_topic
from edge_agent.telemetry.fleet_export import FleetCollector, subscriptions
from edge_agent.telemetry.schema import State
from edge_agent.telemetry.simulate import SimDevice

PREFIX = "acme/edge/v1"


def online(device: str) -> bytes:
    return State(device_id=device, state="online", session=1, boot_id="b", version="t").to_json()


@pytest.mark.parametrize(
    ("topic", "prefix", "expected"),
    [
        ("edge/v1/dev-1/state", "edge/v1", ("dev-1", "state")),
        ("edge/v1/dev-1/tele/latency", "edge/v1", ("dev-1", "tele/latency")),
        ("acme/edge/v1/dev-1/evt/tier_switch", PREFIX, ("dev-1", "evt/tier_switch")),
        ("fleet/dev-1/state", "fleet", ("dev-1", "state")),
        ("site-7/edge/v1/dev-1/meta", "+/edge/v1", ("dev-1", "meta")),  # a '+' level, as subscribed
        ("acme/edge/v1/dev-1/state", "edge/v1", None),  # the old parts[2] read took 'v1' as the device
        ("edge/v10/dev-1/state", "edge/v1", None),  # levels compare whole
        ("acme/edge/v1/dev-1", PREFIX, None),  # no kind
        ("acme/edge/v1//state", PREFIX, None),  # empty device id
        ("acme/edge/v1/dev-1/", PREFIX, None),
        ("acme/edge", PREFIX, None),
        ("", PREFIX, None),
    ],
)
def test_split_device_topic_reads_the_device_after_the_whole_prefix(topic, prefix, expected):
    assert split_device_topic(topic, prefix) == expected


def test_fleet_watch_sees_a_device_under_a_three_level_prefix_from_its_flag():
    args = build_parser().parse_args(["fleet", "watch", "--broker", "localhost:1883", "--prefix", PREFIX])
    view = view_from_args(args)
    view.clock = lambda: 0.0
    dev = SimDevice("dev-1", seed=1, requests_per_window=10)
    view.ingest(f"{PREFIX}/dev-1/state", online("dev-1"))
    view.ingest(f"{PREFIX}/dev-1/tele/latency", dev.window())
    rows = view.rows()
    assert [r["device"] for r in rows["devices"]] == ["dev-1"]
    row = rows["devices"][0]
    assert (row["state"], row["windows"], row["count"]) == ("online", 1, 10)
    assert rows["malformed"] == 0


def test_fleet_export_sees_a_device_under_a_three_level_prefix_from_its_flag():
    args = build_parser().parse_args(
        ["fleet", "export", "--broker", "localhost:1883", "--listen", "127.0.0.1:0", "--prefix", PREFIX]
    )
    store = store_from_args(args)
    dev = SimDevice("dev-1", seed=1, requests_per_window=10)
    store.ingest(f"{PREFIX}/dev-1/state", online("dev-1"))
    store.ingest(f"{PREFIX}/dev-1/tele/latency", dev.window())
    registry = CollectorRegistry()
    registry.register(FleetCollector(store))
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    assert [(s.labels, s.value) for s in samples["edge_fleet_device_online"]] == [({"device": "dev-1"}, 1.0)]
    counts = {
        (s.labels["device"], s.labels["tier"], s.labels["metric"]): s.value
        for s in samples["edge_fleet_latency_ms_count"]
    }
    assert counts == {("dev-1", dev.tier, m): 10 for m in ("ttft_ms", "itl_ms", "e2e_ms")}
    assert store.malformed == 0
    # What the exporter subscribes to is under the same prefix, so the parser and the broker agree.
    assert all(
        t.split("/", 2)[2].startswith(PREFIX) if t.startswith("$share/") else t.startswith(PREFIX)
        for t in subscriptions(args.prefix, args.share_group)
    )


def test_a_topic_outside_the_prefix_is_counted_as_malformed_and_nothing_else_changes():
    dev = SimDevice("dev-1", seed=1, requests_per_window=10)
    window = dev.window()
    outside = [
        "edge/v1/dev-1/tele/latency",  # the default prefix, not the configured one
        "acme/edge/v2/dev-1/tele/latency",
        "acme/edge/v1/dev-1",
        "acme",
    ]
    args = build_parser().parse_args(["fleet", "watch", "--broker", "localhost:1883", "--prefix", PREFIX])
    view = view_from_args(args)
    store = store_from_args(
        build_parser().parse_args(["fleet", "export", "--broker", "h:1", "--listen", "h:2", "--prefix", PREFIX])
    )
    for topic in outside:
        view.ingest(topic, window)
        store.ingest(topic, window)
    assert view.devices == {} and view.malformed == len(outside)
    assert "acme" in (view.last_error or "")
    assert store.devices == {} and store.malformed == len(outside)
