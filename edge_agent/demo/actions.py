"""The demo's voice command turn: a spoken command becomes a tool call on the daemon itself.

The command is streamed to ``GET /v1/audio/stream?respond=true`` with the shipped home-automation tools
(``demo_models/home-tools.json``, ``tool_choice: "required"``) as its reply settings, so each final
transcript is answered by one ``reply`` event carrying one call whose arguments follow the tool's
schema: the daemon's voice turn (early end of turn, prefill and reply ahead, the prefix cache).
``turn_ms`` is the agent's own end of speech → complete call.
"""

from __future__ import annotations

import json
from pathlib import Path

HOME_TOOLS = Path(__file__).resolve().parent.parent / "demo_models" / "home-tools.json"


def home_tools() -> list[dict]:
    return json.loads(HOME_TOOLS.read_text())["tools"]


def reply_settings(tools: list[dict]) -> str:
    """The stream's first message: answer each command with one of ``tools``."""
    return json.dumps({"tools": tools, "tool_choice": "required", "max_tokens": 160})


def action_of(final: dict, reply: dict | None) -> dict:
    """``{"heard", "call": {"name", "arguments"} | None, "turn_ms", "error"}`` for one spoken command: its
    final event and the ``reply`` (or ``error``) event that answered it."""
    heard = final.get("text", "")
    if reply is None or reply.get("kind") != "reply":
        error = (reply or {}).get("message") or "no reply"
        return {"heard": heard, "call": None, "turn_ms": None, "error": error}
    call = None
    for tc in reply.get("tool_calls") or []:
        fn = tc["function"]
        call = {"name": fn["name"], "arguments": json.loads(fn["arguments"])}
        break
    return {"heard": heard, "call": call, "turn_ms": reply.get("complete_ms"), "error": None}
