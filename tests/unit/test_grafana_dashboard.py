"""The shipped Grafana dashboard and Telegraf example query only what a live ``fleet export`` really serves."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.telemetry.fleet_export import FleetCollector, FleetStore, subscriptions
from edge_agent.telemetry.schema import Event
from edge_agent.telemetry.simulate import SimDevice

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
METRIC = re.compile(r"\b(edge_fleet_[a-zA-Z0-9_]+)")
LABEL_MATCH = re.compile(r"\b([a-z_]+)\s*=~?\s*\"")


def live_exposition() -> tuple[set[str], dict[str, set[str]]]:
    """Sample names and their label names, scraped over HTTP from an exporter fed like a real one."""
    store = FleetStore()
    for d in range(2):
        dev = SimDevice(f"dev-{d}", seed=d)
        for suffix, payload in dev.retained():
            store.ingest(f"edge/v1/dev-{d}/{suffix}", payload)
        data = json.loads(dev.window())
        data["health"] = {"cpu": {"temp_c": 55.0}}
        store.ingest(f"edge/v1/dev-{d}/tele/latency", json.dumps(data).encode())
        ev = Event(
            device_id=f"dev-{d}",
            type="tier_switch",
            session=1,
            seq=1,
            at_wall=0.0,
            at_mono=0.0,
            data={"workload": "llm", "from": "large", "to": "small"},
        )
        store.ingest(f"edge/v1/dev-{d}/evt/tier_switch", ev.to_json())
    registry = CollectorRegistry()
    registry.register(FleetCollector(store))
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        thread.join(5)
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return set(labels), labels


def dashboard_exprs() -> list[str]:
    dash = json.loads((SYSTEMD / "grafana-dashboard.json").read_text())
    exprs = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        exprs += [t["expr"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    return exprs


def test_every_dashboard_query_names_metrics_and_labels_the_exporter_serves():
    names, labels = live_exposition()
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for expr in exprs:
        used = METRIC.findall(expr)
        assert used, f"no exporter metric in {expr!r}"
        for name in used:
            assert name in names, f"{name!r} (in {expr!r}) is not served; served: {sorted(names)}"
            for label in LABEL_MATCH.findall(expr):
                assert label in labels[name], f"{name} has no label {label!r} (in {expr!r})"


def test_fleet_percentiles_in_the_dashboard_come_from_summed_buckets_not_averaged_quantiles():
    exprs = [e for e in dashboard_exprs() if "histogram_quantile" in e]
    assert exprs and all("sum by (le" in e for e in exprs)
    assert not any(re.search(r"avg\w*\s*\(.*quantile", e) for e in dashboard_exprs())


def test_the_telegraf_example_is_toml_and_subscribes_to_topics_the_agent_publishes():
    conf = tomllib.loads((SYSTEMD / "telegraf-mqtt.conf.example").read_text())
    topics = [t for block in conf["inputs"]["mqtt_consumer"] for t in block["topics"]]
    plain = subscriptions("edge/v1", None)
    assert set(topics) <= set(plain), topics
