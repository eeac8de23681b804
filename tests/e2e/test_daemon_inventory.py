"""A real daemon's ``meta`` carries the inventory (host, probes, the engine serving each tier) and
``meta.engines``; its ``tele/latency`` windows carry health and each series its ``engine_hash``; all
valid against the checked-in JSON Schemas. /metrics carries the health gauges."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest

from edge_agent.telemetry.schema import SCHEMA_DIR
from tests.daemon_proc import Daemon
from tests.mqtt_broker import Broker, wait_for


def validate(name: str, doc: dict) -> None:
    jsonschema.validate(doc, json.loads((SCHEMA_DIR / f"{name}.json").read_text()))


@pytest.mark.slow
def test_meta_inventory_and_window_health_from_a_running_daemon(tmp_path):
    with Broker(tmp_path / "broker").start() as broker:
        daemon = Daemon(tmp_path / "agent", broker_port=broker.port)
        try:
            daemon.start()
            listener = daemon.listener
            assert listener is not None
            client = openai.OpenAI(base_url=daemon.url("/v1"), api_key="unused", max_retries=0)
            for _ in range(3):  # the first after the load stays out of the windows
                client.chat.completions.create(
                    model="small", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
                )

            def probed() -> dict | None:
                return next((m for m in reversed(listener.of("meta")) if m.get("inventory", {}).get("probed")), None)

            wait_for(lambda: probed() is not None, 90, what="meta with the accelerator probes' inventory")
            meta = probed()
            assert meta is not None
            validate("meta", meta)
            inv = meta["inventory"]
            assert meta["engines"] and set(meta["engines"]) == {"small"}  # not {} while an engine serves
            identity = meta["engines"]["small"]
            assert identity.startswith(("engine:", "model:"))
            serving = {(s["workload"], s["tier"]): s for s in inv["serving"]}
            assert serving[("llm", "small")]["identity"] == identity and serving[("llm", "small")]["loaded"]
            assert inv["config_digest"].startswith("sha256:") and inv["agent_version"] == meta["version"]
            assert inv["cpu_cores"] >= 1 and inv["memory_bytes"] > 0
            assert "onnxruntime" in inv["runtimes"]  # the demo tier runs on it: the probe must find it
            assert "CPUExecutionProvider" in inv["accelerators"]["onnxruntime"]["providers"]

            def served_window() -> dict | None:
                return next((w for w in listener.of("tele/latency") if w.get("series")), None)

            wait_for(lambda: served_window() is not None, 30, what="a window with a series")
            window = served_window()
            assert window is not None
            validate("tele_latency", window)
            assert window["series"][0]["engine_hash"] == identity
            health = window["health"]
            assert health["memory_total_bytes"] > 0 and health["process_rss_bytes"] > 0
            assert isinstance(health["absent"], list)
            for w in listener.of("tele/latency"):
                validate("tele_latency", w)
                assert "health" in w  # every window, with or without traffic
            with urllib.request.urlopen(daemon.url("/metrics"), timeout=10) as resp:
                metrics = resp.read().decode()
            assert "edge_agent:memory_total_bytes" in metrics and "edge_agent:process_resident_memory_bytes" in metrics
        finally:
            daemon.close()
