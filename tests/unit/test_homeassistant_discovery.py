"""Home Assistant discovery without a broker: which entities are offered, that their templates read
the wire payloads (rendered with Jinja, as Home Assistant does), and that the select goes through the
command processor's rules (allow-list, signing, known tiers)."""

from __future__ import annotations

import json

import jinja2

from edge_agent.telemetry import examples
from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.homeassistant import Discovery
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import CommandProcessor
from edge_agent.telemetry.signing import Verifier
from tests.telemetry_target import TinyAgent

TIERS = {"llm": ["large", "small"], "asr": ["base"]}


def discovery(tmp_path, enabled=True, select_allowed=True, submit=None) -> Discovery:
    return Discovery(
        enabled=enabled,
        ha_prefix="homeassistant",
        topic=lambda s: f"edge/v1/dev.17/{s}",
        device_id="dev.17",
        version="1.2.3",
        marker=tmp_path / "ha.json",
        select_allowed=select_allowed,
        submit=submit or (lambda _m: None),
        wall=lambda: 1000.0,
    )


def render(template: str, payload: dict) -> str:
    return jinja2.Environment().from_string(template).render(value_json=payload).strip()


def test_every_entity_with_llm_and_asr_and_their_templates_on_the_example_payloads(tmp_path):
    configs = discovery(tmp_path).configs(TIERS)
    by_key = {t.split("/")[3]: c for t, c in configs.items()}
    assert set(by_key) == {
        "llm_ttft_p95",
        "llm_ttft_p99",
        "llm_tokens_per_s",
        "asr_first_partial_p95",
        "cpu_temperature",
        "llm_active_tier",
        "asr_active_tier",
        "llm_tier_pin",
        "asr_tier_pin",
    }
    assert all(t.startswith("homeassistant/") and "/edge_agent_dev_17/" in t for t in configs)
    assert {c["default_entity_id"].split(".", 1)[1] for c in configs.values()} == {
        c["unique_id"].lower() for c in configs.values()
    }
    payloads = {ex.topic: ex.json() for ex in examples.topic_examples()}
    win, rep = payloads["tele/latency"], payloads["reported"]
    asr = next(s for s in win["series"] if s["workload"] == "asr")
    llm = next(s for s in win["series"] if s["workload"] == "llm")
    assert (
        float(render(by_key["asr_first_partial_p95"]["value_template"], win)) == asr["local"]["first_partial_ms"]["p95"]
    )
    assert float(render(by_key["llm_ttft_p99"]["value_template"], win)) == llm["local"]["ttft_ms"]["p99"]
    assert render(by_key["asr_active_tier"]["value_template"], rep) == rep["active_tiers"]["asr"]
    assert render(by_key["llm_tier_pin"]["value_template"], rep) == rep["pins"]["llm"]
    assert render(by_key["asr_tier_pin"]["value_template"], rep) == "auto"  # not pinned
    health = win.get("health")
    expected = "None" if not health or health.get("max_temp_c") is None else str(health["max_temp_c"])
    assert render(by_key["cpu_temperature"]["value_template"], win) == expected
    assert render(by_key["cpu_temperature"]["value_template"], {"series": []}) == "None"
    assert render(by_key["llm_tokens_per_s"]["value_template"], {"series": []}) == "0"


def test_no_select_when_it_could_not_work_and_no_subscription_for_it(tmp_path):
    d = discovery(tmp_path, select_allowed=False)
    assert not [t for t in d.configs(TIERS) if "/select/" in t] and d.subscriptions == ()
    assert discovery(tmp_path).subscriptions == ("ha/tier/+/set",)
    assert discovery(tmp_path, enabled=False).subscriptions == ()


def test_offered_topics_are_remembered_and_the_ones_dropped_are_cleared(tmp_path):
    first = discovery(tmp_path).birth(TIERS)
    assert all(m.retain and m.payload for m in first) and len(first) == 9
    fewer = discovery(tmp_path).birth({"llm": ["large", "small"]})
    cleared = {m.topic for m in fewer if not m.payload}
    assert cleared == {m.topic for m in first if "asr" in m.topic}
    off = discovery(tmp_path, enabled=False).birth(TIERS)
    assert off and all(m.retain and m.payload == b"" for m in off)
    assert not (tmp_path / "ha.json").exists() and discovery(tmp_path, enabled=False).birth(TIERS) == []


def run_select(tmp_path, choice: bytes, retain: bool = False, key=None, allowed=None) -> list[dict]:
    sent: list[dict] = []
    proc = CommandProcessor(
        TinyAgent(tiers={"llm": ["large", "small"]}),
        Ledger(tmp_path / "l.sqlite"),
        "edge/v1/dev.17",
        "dev.17",
        lambda _t, b, _c: sent.append(json.loads(b)),
        verifier=Verifier(key, lambda: 1000.0),
        allowed=allowed,
    )
    d = discovery(tmp_path, submit=lambda m: proc.handle(m))
    assert d.handles("edge/v1/dev.17/ha/tier/llm/set") and not d.handles("edge/v1/dev.17/cmd/pin_tier/req")
    d.on_select(Incoming("edge/v1/dev.17/ha/tier/llm/set", choice, None, None, None, retain))
    return sent


def test_the_select_is_a_pin_or_unpin_under_the_command_rules(tmp_path):
    ok = run_select(tmp_path / "a", b"small")
    assert [m["status"] for m in ok] == ["accepted", "executing", "succeeded"] and ok[0]["command"] == "pin_tier"
    assert ok[-1]["result"]["tier"] == "small"  # what the target was asked (TinyAgent echoes it)
    auto = run_select(tmp_path / "b", b"auto")
    assert auto[-1]["command"] == "unpin_tier" and auto[-1]["status"] == "succeeded"
    assert run_select(tmp_path / "c", b"small", retain=True) == []  # a retained choice is not replayed
    unknown = run_select(tmp_path / "d", b"huge")
    assert unknown[-1]["status"] == "rejected" and "not configured" in unknown[-1]["reason"]
    refused = run_select(tmp_path / "e", b"small", allowed=["get_status"])
    assert refused[-1]["status"] == "rejected" and "not allowed" in refused[-1]["reason"]


def test_with_a_fleet_key_a_plain_choice_is_refused_as_unsigned(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate().public_key()
    sent = run_select(tmp_path, b"small", key=key)
    assert [m["status"] for m in sent] == ["rejected"] and "sign" in sent[0]["reason"].lower()
