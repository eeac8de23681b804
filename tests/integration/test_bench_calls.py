"""``edge-agent bench calls`` on a tiny random model: every command of the asked-for sets goes through the
voice-turn request and is judged against its expected call by the same rule the demo uses; the report
counts and lists them; an unknown set is refused."""

from __future__ import annotations

import json

from edge_agent.cli import main
from edge_agent.demo_models.home_commands import DEMO, HELD_OUT, judge


def test_bench_calls_judges_every_command(tmp_path, capsys):
    out = tmp_path / "calls.json"
    code = main(["bench", "calls", "--llm-model", "demo-phi3", "--sets", "demo,held-out", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for key, commands in (("demo/text", DEMO), ("held-out/text", HELD_OUT)):
        res = report["results"][key]
        rows = res["rows"]
        assert [r["said"] for r in rows] == [c.text for c in commands]
        assert [r["heard"] for r in rows] == [c.text for c in commands]  # text: heard is what was written
        assert all(r["right"] == judge(c.call, r["call"]) for r, c in zip(rows, commands, strict=True))
        assert res["right"] == sum(r["right"] for r in rows) and res["of"] == len(commands)
        assert len(res["wrong"]) == res["of"] - res["right"]
        assert res["reply_ms"]["p50"] <= res["reply_ms"]["p95"]
    assert "demo/text" in capsys.readouterr().out


def test_bench_calls_refuses_an_unknown_set(capsys):
    assert main(["bench", "calls", "--llm-model", "demo-phi3", "--sets", "nope"]) != 0
    assert "--sets" in capsys.readouterr().err
