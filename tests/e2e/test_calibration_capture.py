"""Calibration from the field: a real daemon with ``[calibration]`` capture on serves chat, completion and
speech requests; the capture directory it leaves is what ``edge-agent calibrate --data DIR`` calibrates on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import urllib.request
import wave
from pathlib import Path

import pytest

from edge_agent.engines.datasets import read_audio_manifest, read_text_manifest
from tests.daemon_proc import Daemon, config_text
from tests.integration.test_build_onnxruntime import make_recipe
from tests.mqtt_broker import Broker, free_port
from tests.speech import require_tools, speech_wav

aiohttp = pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
PROMPT = "The quick brown fox"
SPOKEN = "turn on the kitchen light"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


async def _upload(url: str, wav: bytes) -> dict:
    form = aiohttp.FormData()
    form.add_field("file", wav, filename="a.wav", content_type="audio/wav")
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=form, timeout=aiohttp.ClientTimeout(total=120)) as resp,
    ):
        body = await resp.json()
        assert resp.status == 200, body
        return body


@pytest.mark.slow
def test_a_capture_from_a_running_daemon_calibrates(tmp_path: Path) -> None:
    require_tools()
    capture = tmp_path / "capture"
    broker = Broker(tmp_path).start()
    api_port = free_port()
    cfg = config_text(tmp_path, broker.port, api_port).replace("asr = []\n", "")
    cfg += '\n[[models.asr]]\nname = "ctc"\nmodel = "demo-asr"\n'
    cfg += f'\n[engines]\nbuild_on_start = false\n\n[calibration]\ncapture_dir = "{capture}"\ncapture_rate = 1.0\n'
    env = {"CACHE_DIRECTORY": str(tmp_path / "cache"), "STATE_DIRECTORY": str(tmp_path / "state")}
    d = Daemon(tmp_path, broker_port=broker.port, config=cfg, api_port=api_port, env=env)
    try:
        d.start(timeout_s=240)
        for messages in CHATS:
            _post(d.url("/v1/chat/completions"), {"messages": messages, "max_tokens": 4})
        _post(d.url("/v1/completions"), {"prompt": PROMPT, "max_tokens": 4})
        metas = d.listener.of("meta") if d.listener is not None else []
        assert metas and metas[-1]["calibration_capture"].startswith(f"on: llm, asr into {capture}, rate 1")
        heard = asyncio.run(_upload(d.url("/v1/audio/transcriptions"), speech_wav(SPOKEN).read_bytes()))["text"]
        d.signal(signal.SIGTERM)
        assert d.wait(90) == 0
        out = d.output()
    finally:
        out = d.close()
        broker.stop()
    assert f"calibration capture: on: llm, asr into {capture}" in out  # the start-up summary says so

    # What the clients sent, in the manifest format a build reads; the speech with the recogniser's final.
    texts = read_text_manifest(capture / "llm.jsonl")
    assert [t.messages for t in texts[:3]] == [tuple((m["role"], m["content"]) for m in c) for c in CHATS]
    assert texts[3].prompt == PROMPT and len(texts) == 4
    audio = read_audio_manifest(capture / "asr.jsonl", need_text=True)
    assert heard.strip() and " ".join(a.text or "" for a in audio).strip() == heard.strip()
    with wave.open(str(audio[0].audio)) as w:
        assert (w.getnchannels(), w.getframerate()) == (1, 16000) and w.getnframes() > 8000
    for f in capture.rglob("*"):
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) & 0o027 == 0, f

    env = {
        **os.environ,
        "EDGE_AGENT_ENGINES__CACHE_DIR": str(tmp_path / "engines"),
        "EDGE_AGENT_MODELS__CACHE_DIR": str(tmp_path / "models"),
        "EDGE_AGENT_DEVICE__THREADS": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "calibrate",
            "--recipe",
            str(make_recipe(tmp_path)),
            "--target",
            "cpu",
            "--data",
            str(capture),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["calibration_data"] == str(capture / "llm.jsonl")
    assert any(e.get("cache") for e in report["engines"])
