"""The demo's voice command turn: a spoken command becomes a tool call on the daemon itself.

The command is streamed to ``GET /v1/audio/stream?respond=true`` with the shipped home-automation tools
(``demo_models/home-tools.json``, ``tool_choice: "auto"``) as its reply settings, so each final
transcript is answered by one ``reply`` event: a call whose arguments follow its tool's schema, or words
when no tool fits ("what time is it"). That is the daemon's voice turn (early end of turn, prefill and
reply ahead, the prefix cache). ``turn_ms`` is the agent's own end of speech → complete reply. Each
action is judged against the command's expected call (``demo_models.home_commands.judge``).
"""

from __future__ import annotations

import json
from pathlib import Path

HOME_TOOLS = Path(__file__).resolve().parent.parent / "demo_models" / "home-tools.json"


def home_tools() -> list[dict]:
    return json.loads(HOME_TOOLS.read_text())["tools"]


def reply_settings(tools: list[dict], tool_choice: str = "required", max_tokens: int = 160) -> str:
    """The stream's first message: answer each command with one of ``tools`` (``"auto"``: or with words)."""
    return json.dumps({"tools": tools, "tool_choice": tool_choice, "max_tokens": max_tokens})


def action_of(final: dict, reply: dict | None, said: str = "", expected: dict | None = None) -> dict:
    """``{"said", "heard", "expected", "call": {"name", "arguments"} | None, "text", "turn_ms", "error",
    "right"}`` for one spoken command: its final event, the ``reply`` (or ``error``) event that answered
    it, and what was said with the call it should have become (None: no call is due)."""
    from ..demo_models.home_commands import judge

    heard = final.get("text", "")
    base = {"said": said, "heard": heard, "expected": expected}
    if reply is None or reply.get("kind") != "reply":
        error = (reply or {}).get("message") or "no reply"
        return {**base, "call": None, "text": "", "turn_ms": None, "error": error, "right": False}
    call, error = None, None
    for tc in reply.get("tool_calls") or []:
        fn = tc["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if reply.get("finish_reason") != "tool_calls" or not isinstance(args, dict):
            error = f"{fn['name']} cut short, not executed"  # a call that does not parse is never run
        else:
            call = {"name": fn["name"], "arguments": args}
        break
    text = reply.get("text") or ""
    right = error is None and judge(expected, call)  # a call cut short is no answer, even where none was due
    return {**base, "call": call, "text": text, "turn_ms": reply.get("complete_ms"), "error": error, "right": right}
