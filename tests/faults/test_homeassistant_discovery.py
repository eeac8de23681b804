"""Home Assistant MQTT discovery against a real ``edge-agent run`` and a real mosquitto: the retained
configs carry the keys Home Assistant's discovery schema needs, their templates read the device's
own payloads, the tier ``select`` pins a tier through the device's command path, and turning
discovery off clears the configs at the next start."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import jinja2
import pytest

from tests.daemon_proc import Daemon, config_text, free_port, wait_for
from tests.mqtt_broker import Broker

paho = pytest.importorskip("paho.mqtt.client")

TWO_TIERS = (
    'name = "top"\nmodel = "demo-phi3"\nmax_new_tokens = 48\nmax_batch = 2\n\n'
    '[[models.llm]]\nname = "light"\nmodel = "demo-phi3"\nmax_new_tokens = 48\nmax_batch = 2\n'
)
ONE_TIER = 'name = "small"\nmodel = "demo-phi3"\nmax_new_tokens = 48\nmax_batch = 2\n'
PREFIX = "edge/v1/dev-e2e"
ID = re.compile(r"^[A-Za-z0-9_-]+$")
# Home Assistant's device classes for these units (its sensor docs): duration takes ms, temperature °C.
UNITS = {"duration": {"ms", "s", "min", "h", "d"}, "temperature": {"°C", "°F", "K"}}


class HomeAssistantSide:
    """What Home Assistant's MQTT integration sees: everything under the discovery prefix, retained flag kept."""

    def __init__(self, port: int, prefix: str = "homeassistant") -> None:
        self.messages: list[tuple[str, bytes, bool]] = []
        self._lock = threading.Lock()
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=f"ha-{time.monotonic_ns()}", protocol=paho.MQTTv5
        )
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, *_a: c.subscribe(f"{prefix}/#", qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, _c, _u, m) -> None:
        with self._lock:
            self.messages.append((m.topic, bytes(m.payload), bool(m.retain)))

    def configs(self) -> dict[str, dict]:
        """The latest config per topic (an empty payload removes it), as Home Assistant keeps them."""
        out: dict[str, dict] = {}
        with self._lock:
            for topic, payload, _retained in self.messages:
                if payload:
                    out[topic] = json.loads(payload)
                else:
                    out.pop(topic, None)
        return out

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def render(template: str, payload: dict) -> str:
    return jinja2.Environment().from_string(template).render(value_json=payload).strip()


def daemon_config(tmp, broker, api, enabled: bool) -> str:
    cfg = config_text(tmp, broker.port, api).replace(ONE_TIER, TWO_TIERS)
    return cfg.replace(
        'device_id = "dev-e2e"\n',
        f'device_id = "dev-e2e"\nhomeassistant_discovery = {"true" if enabled else "false"}\n',
    )


@pytest.fixture
def broker(tmp_path):
    b = Broker(tmp_path / "broker").start()
    yield b
    b.kill()


def retained(daemon: Daemon, suffix: str) -> dict:
    return wait_for(lambda: next(iter(daemon.listener.of(suffix)[-1:]), None), 30, what=suffix)


def test_discovery_configs_follow_the_schema_read_real_payloads_and_the_select_pins_a_tier(tmp_path, broker):
    api = free_port()
    ha = HomeAssistantSide(broker.port)
    daemon = Daemon(
        tmp_path / "agent",
        broker_port=broker.port,
        api_port=api,
        config=daemon_config(tmp_path / "agent", broker, api, enabled=True),
    )
    try:
        daemon.start()
        configs = wait_for(lambda: (c := ha.configs()) and len(c) >= 6 and c, 30, what="discovery configs")
        # Retained: a Home Assistant that connects later gets every config at once, flagged retained.
        late = HomeAssistantSide(broker.port)
        wait_for(lambda: len(late.configs()) == len(configs), 10, what="the retained configs")
        assert all(r for _t, _p, r in late.messages) and late.configs() == configs
        late.close()
        keys = {}
        for topic, cfg in configs.items():
            prefix, component, node, object_id, tail = topic.split("/")
            assert (prefix, tail) == ("homeassistant", "config") and ID.match(node) and ID.match(object_id)
            assert component in ("sensor", "select")
            keys[object_id] = (component, cfg)
            # Keys every discovered entity needs: a unique id, a device block, availability from ``state``.
            assert cfg["unique_id"].endswith(object_id)
            assert re.match(rf"^{component}\.[a-z0-9_]+$", cfg["default_entity_id"])
            dev = cfg["device"]
            assert dev["identifiers"] and isinstance(dev["identifiers"], list)
            assert dev["name"] == "dev-e2e" and dev["model"] and dev["sw_version"]
            assert cfg["origin"]["name"] == "edge-agent"
            assert cfg["availability_topic"] == f"{PREFIX}/state"
            assert (cfg["payload_available"], cfg["payload_not_available"]) == ("online", "offline")
            assert cfg["state_topic"].startswith(PREFIX + "/") and cfg["name"]
        assert len({c["unique_id"] for _k, c in keys.values()}) == len(keys)
        assert len({json.dumps(c["device"], sort_keys=True) for _k, c in keys.values()}) == 1
        assert set(keys) == {
            "llm_ttft_p95",
            "llm_ttft_p99",
            "llm_tokens_per_s",
            "cpu_temperature",
            "llm_active_tier",
            "llm_tier_pin",
        }
        for name in ("llm_ttft_p95", "llm_ttft_p99", "llm_tokens_per_s", "cpu_temperature"):
            _c, cfg = keys[name]
            assert cfg["state_topic"] == f"{PREFIX}/tele/latency" and cfg["state_class"] == "measurement"
            assert cfg["unit_of_measurement"]
            if "device_class" in cfg:
                assert cfg["unit_of_measurement"] in UNITS[cfg["device_class"]]
        assert keys["llm_ttft_p95"][1]["device_class"] == "duration"
        assert keys["cpu_temperature"][1]["device_class"] == "temperature"

        # Availability from the agent's own retained state payload.
        state = retained(daemon, "state")
        tmpl = keys["llm_ttft_p95"][1]["availability_template"]
        assert render(tmpl, state) == "online" and render(tmpl, {**state, "state": "offline"}) == "offline"

        # Sensor templates on a real window with requests in it.
        import urllib.request

        for k in range(6):
            body = json.dumps({"model": "top", "prompt": f"Hi {k}", "max_tokens": 8, "temperature": 0}).encode()
            req = urllib.request.Request(daemon.url("/v1/completions"), body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
        win = wait_for(
            lambda: next(
                (
                    w
                    for w in reversed(daemon.listener.of("tele/latency"))
                    for s in w.get("series", [])
                    if s["workload"] == "llm" and "ttft_ms" in s.get("local", {})
                ),
                None,
            ),
            30,
            what="a window with LLM requests",
        )
        llm = next(s for s in win["series"] if s["workload"] == "llm" and "ttft_ms" in s["local"])
        assert float(render(keys["llm_ttft_p95"][1]["value_template"], win)) == llm["local"]["ttft_ms"]["p95"]
        assert float(render(keys["llm_ttft_p99"][1]["value_template"], win)) == llm["local"]["ttft_ms"]["p99"]
        tps = sum(s["throughput"]["tokens_per_s"] for s in win["series"] if s["workload"] == "llm")
        assert float(render(keys["llm_tokens_per_s"][1]["value_template"], win)) == pytest.approx(tps, abs=0.01)
        temp = render(keys["cpu_temperature"][1]["value_template"], win)
        max_temp = (win.get("health") or {}).get("max_temp_c")
        assert temp == ("None" if max_temp is None else str(max_temp))
        assert render(keys["llm_ttft_p95"][1]["value_template"], {**win, "series": []}) == "None"

        # The select: its state from reported, its choice through the device's command path.
        component, sel = keys["llm_tier_pin"]
        assert component == "select" and sel["options"] == ["auto", "top", "light"]
        assert sel["command_topic"] == f"{PREFIX}/ha/tier/llm/set" and sel["state_topic"] == f"{PREFIX}/reported"
        rep = retained(daemon, "reported")
        assert render(sel["value_template"], rep) == "auto"
        assert render(keys["llm_active_tier"][1]["value_template"], rep) == "top"
        ha.client.publish(sel["command_topic"], b"light", qos=1).wait_for_publish(10)
        pinned = wait_for(
            lambda: next(
                (
                    r
                    for r in daemon.listener.of("reported")
                    if r["pins"].get("llm") == "light" and r["active_tiers"].get("llm") == "light"
                ),
                None,
            ),
            60,
            what="reported pinned on light",
        )
        assert render(sel["value_template"], pinned) == "light"
        res = [m for m in daemon.listener.of("cmd/pin_tier/res") if str(m.get("cmd_id", "")).startswith("ha-")]
        assert [m["status"] for m in res] == ["accepted", "executing", "succeeded"]
        # A tier the device does not have is refused by the same checks as any command.
        ha.client.publish(sel["command_topic"], b"huge", qos=1).wait_for_publish(10)
        bad = wait_for(
            lambda: next((m for m in daemon.listener.of("cmd/pin_tier/res") if m["status"] == "rejected"), None),
            20,
            what="the rejection of an unknown tier",
        )
        assert "not configured" in bad["reason"]
        ha.client.publish(sel["command_topic"], b"auto", qos=1).wait_for_publish(10)
        wait_for(lambda: any(not r["pins"] for r in daemon.listener.of("reported")[-1:]), 30, what="unpinned")
    finally:
        ha.close()
        out = daemon.close()
    assert "Traceback" not in out, out[-3000:]


def test_turned_off_the_next_start_clears_the_discovery_topics(tmp_path, broker):
    work = tmp_path / "agent"
    api = free_port()
    first = Daemon(work, broker_port=broker.port, api_port=api, config=daemon_config(work, broker, api, enabled=True))
    try:
        first.start()
        ha = HomeAssistantSide(broker.port)
        published = wait_for(lambda: (c := ha.configs()) and len(c) >= 6 and c, 30, what="discovery configs")
        ha.close()
        first.signal(signal.SIGTERM)
        assert first.wait(60) == 0
    finally:
        first.close()
    second = Daemon(
        work,
        broker_port=broker.port,
        api_port=api,
        name="again",
        config=daemon_config(work, broker, api, enabled=False),
    )
    try:
        watcher = HomeAssistantSide(broker.port)
        wait_for(lambda: len(watcher.configs()) >= 6, 10, what="the retained configs before the restart")
        second.start()
        wait_for(lambda: not watcher.configs(), 30, what="every discovery topic cleared")
        cleared = {t for t, p, _r in watcher.messages if not p}
        assert cleared == set(published)
        watcher.close()
        late = HomeAssistantSide(broker.port)  # a Home Assistant that connects now finds nothing
        time.sleep(1.0)
        assert late.messages == []
        late.close()
    finally:
        second.close()
