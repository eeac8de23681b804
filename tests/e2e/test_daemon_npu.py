"""`edge-agent run` with an NPU LLM tier and an NPU ASR tier on top, the NPU emulated on the CPU by
OpenVINO's NPU plugin (``[device] npu_emulation = "cpu"``), as a user would configure a Core Ultra box.

The daemon reaches READY, says in its start-up summary and in ``meta`` that the NPU is emulated, answers
chat from the NPU tier with the tokens ONNX Runtime gives on the same export, and transcribes speech with
the CPU's text. ``check-config`` accepts the configuration.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from tests.daemon_proc import Daemon, config_text, wait_for
from tests.e2e.test_calibration_capture import _upload
from tests.mqtt_broker import Broker, free_port
from tests.speech import require_tools, speech_samples, speech_wav

pytest.importorskip("openvino")

SPOKEN = "turn off the bedroom lights"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _config(tmp_path: Path, broker_port: int, api_port: int) -> str:
    cfg = config_text(tmp_path, broker_port, api_port)
    cfg = cfg.replace("asr = []\n", "").replace(
        '[[models.llm]]\nname = "small"\nmodel = "demo-phi3"\n',
        '[[models.llm]]\nname = "npu"\nmodel = "demo-phi3"\nbackend = "openvino"\ndevice = "NPU"\n'
        '[[models.llm]]\nname = "cpu"\nmodel = "demo-phi3"\n',
    )
    cfg += '\n[[models.asr]]\nname = "npu-ctc"\nmodel = "demo-asr"\nbackend = "openvino"\ndevice = "NPU"\n'
    cfg += '\n[device]\nnpu_emulation = "cpu"\n\n[engines]\nbuild_on_start = false\n'
    return cfg


def test_a_daemon_serves_chat_and_speech_from_emulated_npu_tiers(tmp_path: Path) -> None:
    require_tools()
    broker = Broker(tmp_path).start()
    api_port = free_port()
    cfg = _config(tmp_path, broker.port, api_port)
    env = {"CACHE_DIRECTORY": str(tmp_path / "cache"), "STATE_DIRECTORY": str(tmp_path / "state")}
    (tmp_path / "agent.toml").write_text(cfg)
    check = subprocess.run(
        [str(Path(sys.executable).parent / "edge-agent"), "check-config", "--config", str(tmp_path / "agent.toml")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    d = Daemon(tmp_path, broker_port=broker.port, config=cfg, api_port=api_port, env=env)
    try:
        d.start(timeout_s=240)
        chat = _post(
            d.url("/v1/completions"),
            {"prompt": "the weather today is", "max_tokens": 12, "temperature": 0, "timings": True},
        )
        heard = asyncio.run(_upload(d.url("/v1/audio/transcriptions"), speech_wav(SPOKEN).read_bytes()))["text"]
        listener = d.listener
        assert listener is not None

        def probed() -> dict | None:  # meta once the accelerator probes ran (they run after start)
            return next((m for m in reversed(listener.of("meta")) if m["inventory"].get("accelerators")), None)

        wait_for(lambda: probed() is not None, 90, what="meta with the accelerator probes' inventory")
        meta = probed()
        assert meta is not None
        d.signal(signal.SIGTERM)
        assert d.wait(90) == 0
    finally:
        out = d.close()
        broker.stop()
    assert "NPU EMULATED on the CPU" in out  # the start-up summary's warning
    assert meta["inventory"]["accelerators"]["npu"] == {"emulated": True, "emulation": "cpu"}
    assert meta["engines"]["npu"].startswith("model:")
    assert chat["model"] == "npu", chat

    ref = resolve_model("demo-phi3", tmp_path / "cache" / "models")
    reference = DecoderLM.open(ref, "onnxruntime")
    try:
        want = reference.tokenizer.decode(
            list(reference.generate_greedy(reference.tokenizer.encode("the weather today is"), 12))
        )
    finally:
        reference.close()
    assert chat["choices"][0]["text"] == want

    cpu = open_recognizer(resolve_model("demo-asr", tmp_path / "cache" / "models"), "onnxruntime")
    try:
        assert heard.strip() == cpu.transcribe(speech_samples(SPOKEN)).text.strip()
    finally:
        cpu.close()
