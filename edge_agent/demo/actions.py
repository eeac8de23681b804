"""The demo's voice command turn: a spoken command's final transcript becomes a tool call.

The transcript goes to ``POST /v1/chat/completions`` with the shipped home-automation tools
(``demo_models/home-tools.json``) and ``tool_choice: "required"``, so the answer is always one call
whose arguments follow the tool's schema. ``turn_ms`` runs from the end of speech to the complete
call: the agent's own end-of-speech → final figure plus what the client waited for the call.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

HOME_TOOLS = Path(__file__).resolve().parent.parent / "demo_models" / "home-tools.json"


def home_tools() -> list[dict]:
    return json.loads(HOME_TOOLS.read_text())["tools"]


async def command_to_call(session: Any, base: str, heard: str, final_ms: float, tools: list[dict]) -> dict:
    """``{"heard", "call": {"name", "arguments"} | None, "turn_ms", "error"}`` for one spoken command."""
    start = time.monotonic()
    body = {
        "model": "edge-agent",
        "messages": [{"role": "user", "content": heard}],
        "tools": tools,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 160,
    }
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        out = await resp.json()
    waited_ms = (time.monotonic() - start) * 1e3
    if resp.status != 200:
        return {"heard": heard, "call": None, "turn_ms": None, "error": out.get("error", {}).get("message")}
    calls = out["choices"][0]["message"].get("tool_calls") or []
    call = None
    if calls:
        fn = calls[0]["function"]
        call = {"name": fn["name"], "arguments": json.loads(fn["arguments"])}
    return {"heard": heard, "call": call, "turn_ms": final_ms + waited_ms, "error": None, "tier": out.get("model")}
