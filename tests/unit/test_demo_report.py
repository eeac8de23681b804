"""The demo judges what it prints: each spoken command's reply against its expected call, the summary's
"N of M right" with the wrong ones and what was heard, the switches with the P95 behind them; and the
daemon config it writes for the real-weights tiers is one the agent loads."""

from __future__ import annotations

import json

import pytest

from edge_agent.demo.actions import action_of
from edge_agent.demo.report import Record, format_summary, summarize
from edge_agent.demo_models.home_commands import light, timer


def _reply(name=None, args=None, text="", finish="tool_calls"):
    calls = [{"function": {"name": name, "arguments": args}}] if name else None
    return {"kind": "reply", "text": text, "tool_calls": calls, "finish_reason": finish, "complete_ms": 250.0}


def test_actions_are_judged_by_name_and_arguments():
    final = {"text": "turn on the kitchen light"}
    ok = action_of(
        final,
        _reply("set_light", '{"room": "kitchen", "on": true}'),
        "turn on the kitchen light",
        light("kitchen", True),
    )
    assert ok["right"] and ok["call"] == light("kitchen", True)
    wrong = action_of(final, _reply("set_light", '{"room": "kitchen", "on": false}'), "x", light("kitchen", True))
    assert not wrong["right"]
    words = action_of({"text": "what time is it"}, _reply(text="Sorry, I cannot do that.", finish="stop"), "q", None)
    assert words["right"] and words["call"] is None and words["text"] == "Sorry, I cannot do that."
    invented = action_of({"text": "what time is it"}, _reply("set_timer", '{"minutes": 5}'), "q", None)
    assert not invented["right"]


def test_a_call_cut_short_is_never_executed_and_is_wrong():
    cut = action_of({"text": "set a timer"}, _reply("set_timer", '{"minu', finish="length"), "set a timer", None)
    assert cut["call"] is None and "cut short" in cut["error"] and not cut["right"]
    missing = action_of({"text": "set a timer for five minutes"}, None, "set a timer for five minutes", timer(5))
    assert missing["call"] is None and not missing["right"]


def test_the_summary_counts_right_calls_lists_the_wrong_ones_and_the_switches():
    rec = Record()
    on = _reply("set_light", '{"room": "kitchen", "on": true}')
    nine = _reply("set_timer", '{"minutes": 9}')
    rec.actions = [
        action_of({"text": "turn on the kitchen light"}, on, "turn on the kitchen light", light("kitchen", True)),
        action_of({"text": "set a timer for nine minutes"}, nine, "set a timer for five minutes", timer(5)),
    ]
    rec.switches = [{"t_s": 21.5, "from": "full", "to": "short", "reason": "ttft_ms P95 1081 ms > target 387 ms"}]
    rec.replies = [("What is the capital of France?", "Paris.")]
    s = summarize(rec)
    assert s["tool_calls"]["right"] == 1 and s["tool_calls"]["commands"] == 2
    assert [w["heard"] for w in s["tool_calls"]["wrong"]] == ["set a timer for nine minutes"]
    json.dumps(s)  # the JSON report carries the same
    text = format_summary(s)
    assert "1 of 2 right (name and arguments)" in text
    assert "said 'set a timer for five minutes', heard 'set a timer for nine minutes'" in text
    assert "full → short: ttft_ms P95 1081 ms > target 387 ms" in text
    assert "'What is the capital of France?' → 'Paris.'" in text


@pytest.mark.embedded_default
def test_the_real_weights_config_loads_with_two_tiers_of_one_model(tmp_path):
    from edge_agent.config import load_settings
    from edge_agent.demo.run import daemon_config

    cfg = daemon_config(tmp_path, ("127.0.0.1", 1883), 8123, speech=True, real=True)
    settings = load_settings(cfg)
    tiers = settings.models.llm
    assert [(t.name, t.model) for t in tiers] == [("full", "gemma-3-270m-home"), ("short", "gemma-3-270m-home")]
    assert tiers[1].max_new_tokens < tiers[0].max_new_tokens
    assert tiers[1].rows(settings.batching) > tiers[0].rows(settings.batching)
    assert load_settings(cfg).sla.target_ms == 387.0  # the default SLA, once the capacity probe is over
    probe = daemon_config(tmp_path, ("127.0.0.1", 1883), 8123, speech=True, real=True, target_ms=600_000)
    assert load_settings(probe).sla.target_ms == 600_000
    random_cfg = (
        daemon_config(tmp_path / "r", ("127.0.0.1", 1883), 8123, speech=False)
        if (tmp_path / "r").mkdir() is None
        else None
    )
    assert [t.model for t in load_settings(random_cfg).models.llm] == ["demo-phi3-small", "demo-phi3"]
