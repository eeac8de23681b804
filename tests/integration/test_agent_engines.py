"""The daemon's engines at start: a cached engine is served; a missing one is built in the background
while the model folder serves, then swapped in without failing a request; a corrupt entry is
quarantined; a gate refusal keeps the model folder; ``rebuild_engine`` builds again.

Real ONNX Runtime builds of the tiny ``demo-phi3`` (a recipe in a temporary ``recipes_dir``), a real
engine cache, the real ``Agent`` in-process (no broker: telemetry spools; events are recorded)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from edge_agent.config import Settings
from edge_agent.daemon.app import Agent
from edge_agent.engines.cache import EngineCache
from edge_agent.engines.pipeline import BuildRequest, Heartbeat, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.errors import EdgeAgentError
from edge_agent.models.sampling import SamplingParams
from edge_agent.systemd import Notifier
from tests.mqtt_broker import free_port

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
name = "tiny-phi3"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = {precisions}
kv_layout = "{kv_layout}"
[calibration]
data = "{root}/calibration/llm/prompts.jsonl"
samples = 8
max_tokens = 24
[heldout]
data = "{root}/calibration/llm/heldout.jsonl"
samples = 4
[accuracy]
min_cosine = {min_cosine}
min_top1 = 0.5
max_kl = 0.5
"""


class RecordingAgent(Agent):
    """The real agent; events are also kept in a list (there is no broker here)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.events: list[tuple[str, dict]] = []

    def _event(self, kind: str, payload: dict) -> None:
        self.events.append((kind, payload))
        super()._event(kind, payload)

    def of(self, kind: str) -> list[dict]:
        return [p for k, p in self.events if k == kind]


def settings(
    tmp: Path,
    precisions: str = '["fp32"]',
    min_cosine: float = 0.9,
    build_on_start: bool = True,
    tiers: list[dict] | None = None,
    kv_layout: str = "inplace",
) -> Settings:
    recipes = tmp / "recipes"
    recipes.mkdir(exist_ok=True)
    text = RECIPE.format(precisions=precisions, root=ROOT, min_cosine=min_cosine, kv_layout=kv_layout)
    (recipes / "tiny-phi3.toml").write_text(text)
    return Settings(
        models={
            "llm": tiers or [{"name": "tiny", "model": "demo-phi3", "max_new_tokens": 8, "max_batch": 2}],
            "asr": [],
        },
        mqtt={"host": "127.0.0.1", "port": free_port(), "device_id": "dev-engines"},
        telemetry={"spool_path": tmp / "spool.sqlite", "ledger_path": tmp / "ledger.sqlite"},
        api={"host": "127.0.0.1", "port": 0},
        engines={"cache_dir": tmp / "engines", "recipes_dir": recipes, "build_on_start": build_on_start},
        device={"threads": 1},
    )


def prebuild(s: Settings, precision: str = "fp32") -> dict:
    recipe = load_recipe(Path(s.engines.recipes_dir) / "tiny-phi3.toml")
    pipe = Pipeline(
        recipe,
        EngineCache(s.engines.cache_dir, s.engines.max_bytes),
        s.models.cache_dir,
        1,
        Heartbeat(enabled=False, notifier=Notifier({})),
    )
    return pipe.build(BuildRequest("cpu", precision))


def served_path(agent: Agent) -> Path:
    return Path(agent.llm._active.lm.ref.path)


def generate(agent: Agent) -> tuple[int, ...]:
    handle = agent.llm.submit("hello", SamplingParams(max_new_tokens=4))
    return handle.result(60).token_ids


@pytest.fixture
def started():
    agents: list[Agent] = []

    def start(agent: Agent) -> Agent:
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        agent.tier_engines().wait_idle(120)
        agent.stop()


def test_a_cached_engine_is_served_at_start_without_building(tmp_path: Path, started) -> None:
    s = settings(tmp_path)
    built = prebuild(s)
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    assert served_path(agent) == Path(built["path"]) / "model"
    assert agent.remote.engine_hashes() == {"tiny": f"engine:{built['key']}"}
    assert generate(agent)
    assert agent.tier_engines().wait_idle(60)
    assert agent.of("engine_build") == []  # nothing to build: the engine was there


def test_a_miss_serves_the_model_folder_at_once_then_swaps_to_the_built_engine(tmp_path: Path, started) -> None:
    s = settings(tmp_path)
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    plain = served_path(agent)
    assert "entries" not in plain.parts  # serving the demo model folder while the build runs
    assert agent.remote.engine_hashes()["tiny"].startswith("model:")
    # Requests keep flowing through the build and the swap; none may fail.
    results, failures, stop = [], [], threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                results.append(generate(agent))
            except Exception as exc:
                failures.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        assert agent.tier_engines().wait_idle(120)
        deadline = time.monotonic() + 60
        while not agent.of("engine_swap") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(30)
    states = [p["state"] for p in agent.of("engine_build")]
    assert states == ["started", "finished"]
    finished = agent.of("engine_build")[-1]
    key = finished["engines"]["tiny"]
    assert agent.of("engine_swap") == [{"workload": "llm", "tier": "tiny", "ok": True, "serving": f"engine:{key}"}]
    assert served_path(agent) == tmp_path / "engines" / "entries" / key / "model"
    assert agent.remote.engine_hashes() == {"tiny": f"engine:{key}"}
    assert failures == [] and len(results) > 0
    assert generate(agent)


def test_a_corrupt_entry_is_quarantined_reported_and_the_model_folder_serves(tmp_path: Path, started) -> None:
    s = settings(tmp_path, build_on_start=False)
    built = prebuild(s)
    graph = Path(built["path"]) / "model" / "model.onnx"
    graph.write_bytes(graph.read_bytes()[:-16] + b"\0" * 16)  # same size, different bytes
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    assert "entries" not in served_path(agent).parts
    [event] = agent.of("engine_quarantined")
    assert event["key"] == built["key"] and "sha256 mismatch" in event["reason"]
    assert not Path(built["path"]).exists()
    assert list((tmp_path / "engines" / "quarantine").glob(f"{built['key']}-*"))
    assert generate(agent)
    assert agent.of("engine_build") == []  # build_on_start = false: no build


def test_a_gate_refusal_keeps_the_model_folder_and_says_why(tmp_path: Path, started) -> None:
    s = settings(tmp_path, precisions='["int8"]', min_cosine=0.99999)
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    assert agent.tier_engines().wait_idle(120)
    started_, done = agent.of("engine_build")
    assert started_["state"] == "started" and started_["precisions"] == ["int8"]
    assert done["state"] == "refused" and done["engines"] == {}
    assert "accuracy gate" in done["problems"][0] and "cosine" in done["problems"][0]
    assert "model folder" in done["serving"]
    assert agent.of("engine_swap") == []
    assert "entries" not in served_path(agent).parts and generate(agent)


def test_without_the_build_tooling_one_event_says_why_and_the_folder_serves(
    tmp_path: Path, started, monkeypatch, caplog
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    agent = started(RecordingAgent(settings(tmp_path, precisions='["fp32", "fp16"]'), notifier=Notifier({}), drain_s=5))
    [event] = agent.of("engine_build")
    assert event["state"] == "failed" and "pip install 'edge-agent[build]'" in event["error"]
    assert "Traceback" not in caplog.text and "entries" not in served_path(agent).parts and generate(agent)


def test_rebuild_engine_command_builds_again_and_unknown_recipes_fail(tmp_path: Path, started) -> None:
    s = settings(tmp_path)
    first = prebuild(s)
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    assert agent.remote.recipes() == ["tiny-phi3"]
    with pytest.raises(EdgeAgentError, match="no engine recipe 'nope'"):
        agent.remote.rebuild_engine("nope")
    result = agent.remote.rebuild_engine("tiny-phi3")  # returns at once; the build runs on its own thread
    assert result == {"recipe": "tiny-phi3", "state": "started", "tiers": ["tiny"]}
    assert agent.tier_engines().wait_idle(120)
    deadline = time.monotonic() + 60
    while not agent.of("engine_swap") and time.monotonic() < deadline:
        time.sleep(0.05)
    done = agent.of("engine_build")[-1]
    assert done["state"] == "finished" and done["built"][0]["cache"] == "built"  # forced: not a cache hit
    assert agent.of("engine_swap")[0]["ok"]
    # The forced rebuild replaced the old entry (same key); the old files went to quarantine.
    assert done["engines"]["tiny"] == first["key"]
    assert any((tmp_path / "engines" / "quarantine").glob(f"{first['key']}-*"))
    assert generate(agent)


def test_a_lighter_tier_builds_in_the_background_for_a_tier_not_serving(tmp_path: Path, started) -> None:
    """The recipe's tier is the lighter one, not serving: the build lands in the cache and that tier
    loads its engine when the controller next switches to it."""
    s = settings(
        tmp_path,
        tiers=[
            {"name": "gemma", "model": "demo-gemma", "max_new_tokens": 8},
            {"name": "tiny", "model": "demo-phi3", "max_new_tokens": 8},
        ],
    )
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    assert agent.llm.active_tier == "gemma"
    assert agent.tier_engines().wait_idle(120)
    assert [p["state"] for p in agent.of("engine_build")] == ["started", "finished"]
    assert agent.of("engine_swap") == []
    assert agent.llm.switch_to(1)
    agent.llm.wait_switched(60)
    assert agent.llm.active_tier == "tiny" and "entries" in served_path(agent).parts


def test_when_no_tier_loads_without_an_engine_the_start_builds_and_keeps_systemd_patient(
    tmp_path: Path, started, monkeypatch
) -> None:
    """Like TensorRT tiers on a fresh Jetson (the model folder cannot run there): the start waits for
    the build, extending systemd's start timeout, then serves the engine. (The plain KV layout: an
    in-place conversion checks itself against the model folder, which this device cannot open.)"""
    import socket

    from edge_agent.errors import ModelError
    from edge_agent.models.llm import DecoderLM

    real_open = DecoderLM.open.__func__

    def only_engines(cls, ref, backend="onnxruntime", options=None, kv_capacity=4096):
        if "entries" not in Path(ref.path).parts:
            raise ModelError(f"{ref.path}: this backend runs built engines only")
        return real_open(cls, ref, backend, options, kv_capacity)

    monkeypatch.setattr(DecoderLM, "open", classmethod(only_engines))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.setblocking(False)
    s = settings(tmp_path, kv_layout="plain")
    agent = started(RecordingAgent(s, notifier=Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}), drain_s=5))
    messages = []
    while True:
        try:
            messages.append(dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines()))
        except BlockingIOError:
            break
    sock.close()
    assert "entries" in served_path(agent).parts and generate(agent)
    assert agent.of("tier_load_failed")[0]["tier"] == "tiny"
    assert [p["state"] for p in agent.of("engine_build")] == ["started", "finished"]
    ready = next(i for i, m in enumerate(messages) if m.get("READY") == "1")
    building = [i for i, m in enumerate(messages) if "building" in m.get("STATUS", "")]
    extends = [i for i, m in enumerate(messages) if "EXTEND_TIMEOUT_USEC" in m]
    assert building and building[0] < ready
    assert any(building[0] < i < ready for i in extends)
    assert all(i < ready for i in extends)


def test_an_openvino_tier_serves_its_cached_ir_engine(tmp_path: Path, started) -> None:
    pytest.importorskip("openvino")
    s = settings(
        tmp_path,
        build_on_start=False,
        tiers=[{"name": "ov", "model": "demo-phi3", "backend": "openvino", "device": "CPU", "max_new_tokens": 8}],
    )
    recipe = load_recipe(Path(s.engines.recipes_dir) / "tiny-phi3.toml")
    built = Pipeline(
        recipe,
        EngineCache(s.engines.cache_dir, s.engines.max_bytes),
        s.models.cache_dir,
        1,
        Heartbeat(enabled=False, notifier=Notifier({})),
    ).build(BuildRequest("cpu", "fp32", "openvino"))
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    assert served_path(agent) == Path(built["path"]) / "model"
    assert agent.llm._active.lm.session.backend == "openvino"
    assert agent.remote.engine_hashes() == {"ov": f"engine:{built['key']}"}
    assert generate(agent)


def test_a_lower_rung_without_an_engine_of_its_own_shares_the_top_rungs_loaded_engine(tmp_path: Path, started) -> None:
    tiers = [
        {"name": "top", "model": "demo-phi3", "max_new_tokens": 8, "max_batch": 2},
        {"name": "low", "model": "demo-phi3", "max_new_tokens": 4, "max_batch": 4, "rung": "lower"},
    ]
    s = settings(tmp_path, tiers=tiers, build_on_start=False)
    built = prebuild(s)
    agent = started(RecordingAgent(s, notifier=Notifier({}), drain_s=5))
    # the recipe has no [rungs.lower]: the lower rung serves the top rung's choice, the same engine
    assert [t.weights for t in agent.llm.tiers] == [f"engine:{built['key']}"] * 2
    model = agent.llm._active.lm
    assert agent.llm.switch_to(1)
    agent.llm.wait_switched(60)
    assert agent.llm.active_tier == "low"
    assert agent.llm._active.lm is model  # nothing loaded: one model serves both tiers
    assert generate(agent)


def test_an_engine_built_with_other_settings_of_its_precision_is_not_the_recipes_as_it_is_now(tmp_path: Path) -> None:
    """A per-precision setting (``block_size = { int8w = 64 }``) is in that precision's key part, not in the
    recipe's fingerprint: an engine built before it changed has the same fingerprint and must still lose."""
    import json

    from edge_agent.engines.resolve import EngineResolver

    s = settings(tmp_path, precisions='["int8w"]', build_on_start=False, kv_layout="plain")
    recipe_file = Path(s.engines.recipes_dir) / "tiny-phi3.toml"
    base = recipe_file.read_text()
    cache = EngineCache(s.engines.cache_dir, s.engines.max_bytes)

    def build(blocks: int) -> dict:
        recipe_file.write_text(base + f"[weight_only]\nblock_size = {{ int8w = {blocks} }}\n")
        recipe = load_recipe(recipe_file)
        pipe = Pipeline(recipe, cache, s.models.cache_dir, 1, Heartbeat(enabled=False, notifier=Notifier({})))
        return pipe.build(BuildRequest("cpu", "int8w"))

    old, now = build(64), build(32)  # the recipe now says 32
    assert old["key"] != now["key"]
    manifests = {
        k: json.loads((Path(r["path"]) / "manifest.json").read_text()) for k, r in (("old", old), ("now", now))
    }
    assert manifests["old"]["key_parts"]["recipe"] == manifests["now"]["key_parts"]["recipe"]
    doc = manifests["old"]  # the older engine's build measured it far faster
    doc["accuracy"]["latency_ms"] = doc["accuracy"]["reference_latency_ms"] / 10
    (Path(old["path"]) / "manifest.json").write_text(json.dumps(doc))
    knows = EngineResolver(cache, s.models.cache_dir, lambda *a: None, s.engines.recipes_dir)
    assert knows.resolve(s.models.llm[0]).engine.key == now["key"]


def test_engines_of_the_recipe_as_it_is_now_outrank_those_of_an_older_version(tmp_path: Path) -> None:
    import json

    from edge_agent.engines.resolve import EngineResolver

    s = settings(tmp_path, build_on_start=False)
    older = tmp_path / "older"
    older.mkdir()
    text = (Path(s.engines.recipes_dir) / "tiny-phi3.toml").read_text()
    (older / "tiny-phi3.toml").write_text(text.replace("max_kl = 0.5", "max_kl = 0.6"))  # another fingerprint
    cache = EngineCache(s.engines.cache_dir, s.engines.max_bytes)

    def build(recipe_dir: Path) -> dict:
        recipe = load_recipe(recipe_dir / "tiny-phi3.toml")
        pipe = Pipeline(recipe, cache, s.models.cache_dir, 1, Heartbeat(enabled=False, notifier=Notifier({})))
        return pipe.build(BuildRequest("cpu", "fp32"))

    old, now = build(older), build(Path(s.engines.recipes_dir))
    assert old["key"] != now["key"]
    # the older engine's build measured it far faster (as a build on idler cores would have)
    manifest = Path(old["path"]) / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["accuracy"]["latency_ms"] = doc["accuracy"]["reference_latency_ms"] / 10
    manifest.write_text(json.dumps(doc))
    tier = s.models.llm[0]
    knows = EngineResolver(cache, s.models.cache_dir, lambda *a: None, s.engines.recipes_dir)
    assert knows.resolve(tier).engine.key == now["key"]
    # a recipe edited back (as before a rebuild): read again, its engine is the one of the recipe as it is
    recipe_file = Path(s.engines.recipes_dir) / "tiny-phi3.toml"
    recipe_file.write_text((older / "tiny-phi3.toml").read_text())
    knows.reread_recipes()
    assert knows.resolve(tier).engine.key == old["key"]
    recipe_file.write_text(text)
    knows.reread_recipes()
    # without the recipe as it is now among those it knows, the fastest by its own build serves
    blind = EngineResolver(cache, s.models.cache_dir, lambda *a: None, tmp_path / "no-recipes")
    assert blind.resolve(tier).engine.key == old["key"]
    # and with none of the current recipe's engines in the cache, the older one serves
    cache.quarantine(now["key"], "test: gone")
    assert (
        EngineResolver(cache, s.models.cache_dir, lambda *a: None, s.engines.recipes_dir).resolve(tier).engine.key
        == old["key"]
    )
