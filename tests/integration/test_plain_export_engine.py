"""A tier pointed at a plain Phi-3 export folder that no recipe builds: the daemon serves the folder at
once, builds an FP32 engine with the in-place KV layout in the background, swaps to it, and answers
the same greedy tokens as the export did (the reference: the plain graph, served before the swap).

Real ONNX Runtime, a copy of the PyTorch-exported ``demo-phi3`` folder, the real ``Agent`` in-process."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from edge_agent.config import Settings
from edge_agent.models.catalog import resolve_model
from edge_agent.models.sampling import SamplingParams
from edge_agent.systemd import Notifier
from tests.integration.test_agent_engines import RecordingAgent, served_path, started  # noqa: F401 (fixture)
from tests.mqtt_broker import free_port

PROMPTS = ("hello", "The capital of France is")


def export_copy(tmp: Path, name: str = "my phi3 export") -> Path:
    """A user's folder: the demo export copied under a name of their own (no recipe knows it)."""
    src = resolve_model("demo-phi3", Settings().models.cache_dir).path
    dst = tmp / name
    shutil.copytree(src, dst)
    return dst


def settings(tmp: Path, folder: Path, convert: bool = True) -> Settings:
    return Settings(
        models={"llm": [{"name": "mine", "model": str(folder), "max_new_tokens": 8, "max_batch": 2}], "asr": []},
        mqtt={"host": "127.0.0.1", "port": free_port(), "device_id": "dev-plain-export"},
        telemetry={"spool_path": tmp / "spool.sqlite", "ledger_path": tmp / "ledger.sqlite"},
        api={"host": "127.0.0.1", "port": 0},
        engines={"cache_dir": tmp / "engines", "recipes_dir": tmp / "recipes", "convert_plain_exports": convert},
        device={"threads": 1},
    )


def greedy(agent) -> list[tuple[int, ...]]:
    return [
        agent.llm.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)).result(60).token_ids for p in PROMPTS
    ]


def test_a_plain_export_without_a_recipe_is_served_then_swapped_to_its_inplace_engine(tmp_path: Path, started) -> None:  # noqa: F811
    folder = export_copy(tmp_path)
    agent = started(RecordingAgent(settings(tmp_path, folder), notifier=Notifier({}), drain_s=5))
    assert served_path(agent) == folder.resolve()
    before = greedy(agent)  # the export as it is: present fed back as past
    assert agent.tier_engines().wait_idle(180)
    deadline = time.monotonic() + 60
    while not agent.of("engine_swap") and time.monotonic() < deadline:
        time.sleep(0.05)
    builds = agent.of("engine_build")
    assert [b["state"] for b in builds] == ["started", "finished"], builds
    assert builds[0]["recipe"].startswith("inplace-my-phi3-export-")
    assert builds[0]["precisions"] == ["fp32"]
    key = builds[-1]["engines"]["mine"]
    assert agent.of("engine_swap") == [{"workload": "llm", "tier": "mine", "ok": True, "serving": f"engine:{key}"}]
    engine = served_path(agent)
    assert engine == tmp_path / "engines" / "entries" / key / "model"
    # the in-place layout: an onnxruntime-genai style folder with GroupQueryAttention and shared buffers
    genai = json.loads((engine / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is True
    assert greedy(agent) == before


def test_the_conversion_can_be_switched_off(tmp_path: Path, started) -> None:  # noqa: F811
    folder = export_copy(tmp_path)
    agent = started(RecordingAgent(settings(tmp_path, folder, convert=False), notifier=Notifier({}), drain_s=5))
    assert agent.tier_engines().wait_idle(30)
    assert agent.of("engine_build") == []
    assert served_path(agent) == folder.resolve()
