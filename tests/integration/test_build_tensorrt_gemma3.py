"""The jetson build path of an imported Gemma 3, with the shipped recipe, on a tiny random Gemma 3.

The GGUF (``tests/gguf_files.py``) says what the real 270M's says about the context (32,768) and the
sliding window (512); its vocabulary and widths are tiny. Built by the fake ``tensorrt`` (10.3 and
11.4): the network TensorRT parses has no ``logits_to_keep`` input and keeps the last position's
logits; the prefill and decode profiles are checked against what the imported config.json implies;
the session sizes ``logits`` for [batch, 1, vocab] and serves a prompt through both profiles. The
gate's scoring of such an engine (one token a call after a prefill) is checked on ONNX Runtime, on
the very graph TensorRT parses, against the imported graph's every-position logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import edge_agent.engines.pipeline as pipeline_mod
from edge_agent.backends import SessionOptions, last_position_only, open_session
from edge_agent.engines.cache import EngineCache
from edge_agent.engines.datasets import TextSample
from edge_agent.engines.heartbeat import Heartbeat
from edge_agent.engines.model_io import LlmProbe
from edge_agent.engines.pipeline import BuildRequest, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.engines.stages import compile_artifact, convert, weight_only_unsupported
from edge_agent.graphs.tensorrt import last_position_graph
from edge_agent.models.catalog import inspect_folder
from edge_agent.models.perplexity import perplexity
from edge_agent.systemd import Notifier
from tests.conftest import REPO
from tests.fakes import fake_tensorrt
from tests.fakes.fake_cuda import FakeCuda
from tests.gguf_files import Q, TinyConfig, make_weights, spm_vocab, write_gguf

TINY = TinyConfig(
    "gemma3", layers=2, hidden=32, heads=4, kv_heads=1, head_dim=16, ffn=64, vocab=spm_vocab(), tied=True,
    rope_base=1_000_000.0, window=512, context=32_768, seed=7, types={"token_embd": Q.Q8_0},
)  # fmt: skip
RECIPE = REPO / "engines" / "gemma-3-270m.toml"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from edge_agent.importers import import_model

    root = tmp_path_factory.mktemp("gemma3-trt")
    src = write_gguf(root / "tiny-gemma3.gguf", TINY, make_weights(TINY))
    return import_model(src, root / "gemma3", root / "cache").path


@pytest.fixture(params=["10.3.0.26", "11.4.0"])
def trt_version(request, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt.as_version(request.param))
    real = pipeline_mod.runtime_version
    monkeypatch.setattr(pipeline_mod, "runtime_version", lambda b: request.param if b == "tensorrt" else real(b))
    return request.param


def pipeline(tmp_path: Path, folder: Path) -> Pipeline:
    recipe = load_recipe(RECIPE).model_copy(update={"model": str(folder)})
    heartbeat = Heartbeat(enabled=False, notifier=Notifier({}))
    return Pipeline(recipe, EngineCache(tmp_path / "engines", 1 << 30), tmp_path / "models", 1, heartbeat)


def build(tmp_path: Path, folder: Path, precision: str = "fp16") -> tuple[dict, dict]:
    pipe = pipeline(tmp_path, folder)
    req = BuildRequest("jetson", precision)
    parts = pipe.key_parts(req)
    staged = tmp_path / "staged"
    staged.mkdir()
    convert(pipe.stage_context(), staged, parts, req)
    compiled = compile_artifact(pipe.stage_context(), staged, parts, req)
    return compiled, json.loads((staged / "model" / "model.plan").read_bytes())


def test_the_shipped_recipe_plans_fp32_fp16_and_int8_for_tensorrt(tmp_path: Path, folder: Path) -> None:
    recipe = load_recipe(RECIPE)
    assert "jetson" in recipe.targets
    pipe = pipeline(tmp_path, folder)
    assert pipe.backend_for(BuildRequest("jetson", "fp16")) == "tensorrt"
    planned = [p for p in recipe.precisions if weight_only_unsupported("tensorrt", p) is None]
    assert planned == ["fp32", "fp16", "int8"]  # int8w / int4 are skipped with a reason
    assert [p.name for p in recipe.profiles_for("jetson")] == ["prefill", "decode"]
    assert recipe.profiles_for("cpu") == []


def test_the_parsed_network_keeps_the_last_position_and_the_profiles_follow_the_config(
    tmp_path: Path, folder: Path, trt_version: str
) -> None:
    config = json.loads((folder / "config.json").read_text())
    window, context = config["sliding_window"], config["max_position_embeddings"]
    vocab, kv, head = config["vocab_size"], config["num_key_value_heads"], config["head_dim"]
    compiled, plan = build(tmp_path, folder)
    assert compiled["profiles"] == ["prefill", "decode"] and "last position" in compiled["logits"]
    tensors = {t["name"]: t for t in plan["tensors"]}
    assert "logits_to_keep" not in tensors  # not an input, and not the every-position constant either
    assert tensors["logits"]["dims"] == ["batch_size", 1, vocab]
    inputs = {n for n, t in tensors.items() if t["mode"] == "INPUT"}
    assert inputs == {"input_ids", "attention_mask", "position_ids"} | {
        f"past_key_values.{i}.{kv_}" for i in range(TINY.layers) for kv_ in ("key", "value")
    }
    prefill, decode = plan["profiles"]
    for profile in (prefill, decode):
        for (b, s), (b2, t), (b3, heads, p, d) in zip(
            profile["input_ids"], profile["attention_mask"], profile["past_key_values.1.value"]
        ):
            assert b == b2 == b3 and t == p + s and (heads, d) == (kv, head)  # every level a real call's shapes
        assert profile["position_ids"] == profile["input_ids"]
    lo, _, hi = prefill["input_ids"]
    assert lo[1] == 2 and hi[1] == window  # prompts of 2+ tokens, in chunks of at most the window
    assert all(s[1] == 1 for s in decode["input_ids"])  # decode: one token, from an empty past on
    assert decode["past_key_values.0.key"][0][2] == 0 and decode["attention_mask"][0][1] == 1
    total = decode["attention_mask"][2][1]
    assert total == prefill["attention_mask"][2][1] <= context  # one context for both profiles
    assert decode["past_key_values.0.key"][2][2] == total - 1
    assert prefill["past_key_values.0.key"][2][2] == total - window  # a last chunk continues a cached past


def test_the_session_holds_last_position_logits_and_serves_through_both_profiles(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edge_agent.backends.tensorrt import open as open_trt
    from edge_agent.models.llm import DecoderLM

    version = fake_tensorrt.__version__  # the fake runtime loads its own version's plans
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt.as_version(version))
    real = pipeline_mod.runtime_version
    monkeypatch.setattr(pipeline_mod, "runtime_version", lambda b: version if b == "tensorrt" else real(b))
    _, plan = build(tmp_path, folder)
    config = json.loads((folder / "config.json").read_text())
    engine = tmp_path / "served"
    engine.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".onnx" and not f.name.endswith(".data"):
            (engine / f.name).write_bytes(f.read_bytes())
    (engine / "model.plan").write_bytes((tmp_path / "staged" / "model" / "model.plan").read_bytes())
    session = open_trt(engine / "model.plan", SessionOptions(device="cuda", extra={"cuda": FakeCuda()}))
    try:
        batch = max(p["input_ids"][2][0] for p in plan["profiles"])
        total = max(p["attention_mask"][2][1] for p in plan["profiles"])
        sizes = session.io_buffer_bytes
        assert sizes["logits"] == batch * 1 * config["vocab_size"] * 4  # not batch x 512 x vocab
        kv_bytes = batch * config["num_key_value_heads"] * total * config["head_dim"] * 4
        assert sizes["present.0.key"] == kv_bytes and sizes["past_key_values.0.key"] == kv_bytes - kv_bytes // total
        assert last_position_only(session)
        prompt = session.run(
            {
                "input_ids": np.ones((2, 5), np.int64),
                "attention_mask": np.ones((2, 5), np.int64),
                "position_ids": np.tile(np.arange(5, dtype=np.int64), (2, 1)),
                **{
                    f"past_key_values.{i}.{k}": np.zeros((2, 1, 0, 16), np.float32)
                    for i in range(TINY.layers)
                    for k in ("key", "value")
                },
            }
        )
        assert prompt["logits"].shape == (2, 1, config["vocab_size"]) and prompt["present.1.value"].shape[2] == 5
        lm = DecoderLM(inspect_folder(engine, name="tiny"), session)
        lm.warmup()  # a two-token prompt (prefill profile), then a step (decode profile)
        assert len(list(lm.generate_greedy([2, 40, 41], 3, stop_at_eos=False))) == 3
    finally:
        session.close()


def test_the_gate_scores_a_last_position_graph_like_every_position(tmp_path: Path, folder: Path) -> None:
    serialized, _ = last_position_graph(folder / "model.onnx")
    assert serialized is not None and last_position_graph(folder / "model.onnx")[0] == serialized
    graph = onnx.load_model_from_string(serialized).graph
    assert "logits_to_keep" not in [i.name for i in graph.input]
    keep = next(t for t in graph.initializer if t.name == "logits_to_keep")
    assert onnx.numpy_helper.to_array(keep) == 1
    trt_graph = folder / "last-position.onnx"  # beside the weights it refers to, as the parser reads it
    trt_graph.write_bytes(serialized)
    options = SessionOptions(threads=1)
    every = open_session(folder / "model.onnx", "onnxruntime", options, warmup=lambda s: None)
    last = open_session(trt_graph, "onnxruntime", options, warmup=lambda s: None)
    config = json.loads((folder / "config.json").read_text())
    ids = np.random.default_rng(3).integers(3, TINY.n_vocab, size=37).tolist()
    try:
        assert last_position_only(last) and not last_position_only(every)
        want = perplexity(every, ids, config, bos=2, window=16, stride=8, chunk=5)
        got = perplexity(last, ids, config, bos=2, window=16, stride=8, chunk=5)
        assert got.tokens == want.tokens and np.array_equal(got.argmax, want.argmax)
        assert got.perplexity == pytest.approx(want.perplexity, rel=1e-5)
        ref = inspect_folder(folder, name="tiny")
        sample = [TextSample(1, "the water boils and the cold world", None)]
        full = LlmProbe(ref).run(every, sample).outputs[0]
        tail = LlmProbe(ref).run(last, sample).outputs[0]
        assert len(full) >= 4 and len(tail) == len(full) - len(full) // 2 + 1
        np.testing.assert_allclose(tail, full[len(full) - len(tail) :], rtol=1e-4, atol=1e-4)
        speed = LlmProbe(ref).run(last, sample, every_position=False).outputs[0]
        np.testing.assert_allclose(speed, full[-1:], rtol=1e-4, atol=1e-4)
    finally:
        every.close()
        last.close()
