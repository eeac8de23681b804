"""Spoken commands to ``edge-agent run`` as a subprocess (demo-asr and demo-phi3 tiers): the speech
WebSocket's ``?respond=true`` with the shipped home tools answers each final with one ``reply`` whose
call follows the tools' schema; a client that leaves mid-turn leaves the daemon serving the next one."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from edge_agent.demo.actions import home_tools, reply_settings
from edge_agent.models.grammar import tool_call_schema
from tests.daemon_proc import speech_daemon
from tests.mqtt_broker import Broker
from tests.speech import require_tools, speech_samples

aiohttp = pytest.importorskip("aiohttp")
jsonschema = pytest.importorskip("jsonschema")


def _pcm(text: str, voice: str) -> bytes:
    samples = np.concatenate([speech_samples(text, voice=voice), np.zeros(16000, np.float32)])
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


async def _turn(url: str, pcm: bytes, leave_early: bool = False) -> list[dict]:
    events: list[dict] = []
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        await ws.send_str(reply_settings(home_tools()))
        for i in range(0, len(pcm), 3200):
            await ws.send_bytes(pcm[i : i + 3200])
        if leave_early:
            return events  # gone without "end": its turn is dropped
        await ws.send_str("end")
        async for msg in ws:
            events.append(json.loads(msg.data))
    return events


@pytest.mark.slow
def test_spoken_commands_get_tool_calls_from_the_daemon(tmp_path):
    require_tools()
    broker = Broker(tmp_path).start()
    d = speech_daemon(tmp_path, broker.port, max_new_tokens=200)  # room for a whole call
    try:
        d.start(timeout_s=240)
        url = d.url("/v1/audio/stream").replace("http", "ws") + "?respond=true"
        asyncio.run(_turn(url, _pcm("turn off the bathroom light", "en-us"), leave_early=True))
        schema = tool_call_schema(home_tools())
        for text, voice in (("set a timer for ten minutes", "en+f2"), ("turn on the kitchen light", "en-us")):
            events = asyncio.run(_turn(url, _pcm(text, voice)))
            finals = [e for e in events if e["kind"] == "final" and e["text"]]
            replies = [e for e in events if e["kind"] == "reply"]
            assert finals and len(replies) == len(finals), events
            for reply in replies:
                (call,) = reply["tool_calls"]
                fn = call["function"]
                jsonschema.validate({"name": fn["name"], "arguments": json.loads(fn["arguments"])}, schema)
                assert reply["complete_ms"] is not None and reply["cached_tokens"] >= 0
    finally:
        out = d.close()
        broker.stop()
    assert "Traceback" not in out, out[-4000:]
