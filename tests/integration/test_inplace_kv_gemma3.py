"""In-place KV conversion of Gemma 3 folders written by the GGUF importer.

A tiny Gemma 3 (random weights, written as llama.cpp writes a GGUF: tests/gguf_files.py) is imported
with ``edge-agent models import``'s importer, whose graph is itself held to a numpy reference in
test_gguf_import.py. Its in-place form must decode like it: logits on the bare runtime at every
teacher-forced step past the sliding window (window 4, prompts of 12 tokens), and greedy tokens
through the agent's scheduler on the in-place buffers. What makes Gemma 3 differ from Gemma-2 (the
local RoPE base, the 5:1 layer pattern, the attention scale, the q/k norms) is each shown to matter:
a config.json that misstates it is refused by the conversion's check. The real Gemma 3 270M
(slow lane) converts and its greedy tokens equal transformers' (tests/data/gemma3/reference.npz),
also past its 512-token window.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.engines.inplace_kv import InplaceCheckFailed, convert_inplace, is_plain_decoder
from edge_agent.engines.inplace_kv_weights import read_arch
from edge_agent.models.catalog import inspect_folder
from edge_agent.models.kv_slots import SlotCache
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler
from tests.conftest import REPO
from tests.gguf_files import Q, TinyConfig, make_weights, spm_vocab, write_gguf
from tests.integration.test_inplace_kv import _bare_steps

# 7 layers: the 6th attends globally, the others slide over 4 tokens; 4 query heads over 2 KV heads
TINY = TinyConfig(
    "gemma3", layers=7, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, vocab=spm_vocab(), tied=True,
    rope_base=1_000_000.0, window=4, seed=11, types={"attn_q": Q.Q8_0, "ffn_up": Q.Q8_0},
)  # fmt: skip
PROMPTS = [list(range(5, 17)), [40, 41, 42, 43, 44, 45, 46]]  # 12 and 7 tokens, both longer than the window
STEPS = 16


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    from edge_agent.importers import import_model

    root = tmp_path_factory.mktemp("gemma3")
    src = write_gguf(root / "tiny-gemma3.gguf", TINY, make_weights(TINY))
    return import_model(src, root / "plain", root / "cache").path


@pytest.fixture(scope="module")
def converted(plain, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gemma3-inplace") / "inplace"
    report = convert_inplace(plain, out, check_tokens=STEPS)
    return out, report


def test_an_imported_gemma3_folder_is_a_plain_decoder_the_conversion_takes(plain):
    assert is_plain_decoder(plain)
    arch = read_arch(plain)
    assert arch.windows == (4, 4, 4, 4, 4, -1, 4)
    assert arch.rope_thetas == (10_000.0,) * 5 + (1_000_000.0, 10_000.0)
    assert arch.scale == pytest.approx(TINY.head_dim**-0.5)  # query_pre_attn_scalar = head size


def test_converted_logits_match_the_imported_export_past_the_window(plain, converted):
    out, report = converted
    assert report["family"] == "gemma3_text"
    assert report["check"]["greedy_equal"] and report["check"]["tokens"] == STEPS
    cfg = json.loads((plain / "config.json").read_text())
    for prompt in PROMPTS:
        ref = _bare_steps(plain, cfg, prompt, STEPS, positions=True)
        got = _bare_steps(out, cfg, prompt, STEPS, positions=False)
        for step, (r, g) in enumerate(zip(ref, got)):
            scale = max(1.0, float(np.abs(r).max()))
            assert np.abs(r - g).max() <= 1e-4 * scale, (len(prompt), step)
            assert (r.argmax(-1) == g.argmax(-1)).all(), (len(prompt), step)


def test_the_converted_graph_uses_group_query_attention_with_per_layer_windows_and_bases(converted):
    import onnx

    model = onnx.load(str(converted[0] / "model.onnx"), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == TINY.layers
    windows = [next(a.i for a in n.attribute if a.name == "local_window_size") for n in gqa]
    assert windows == [4, 4, 4, 4, 4, -1, 4]
    caches = [n.input[7] for n in gqa]
    assert caches[5] != caches[0] and len(set(caches)) == 2  # the global layer rotates with its own base
    assert all(n.input[1] and n.input[2] for n in gqa)  # query, key and value apart: the q/k norms precede GQA
    assert all(next(a.f for a in n.attribute if a.name == "softcap") == 0.0 for n in gqa)
    assert {o.name for o in model.graph.input} >= {"past_key_values.0.key", "past_key_values.6.value"}


def test_scheduler_on_the_converted_folder_greedy_equals_decoderlm_on_the_imported_one(plain, converted):
    options = SessionOptions(threads=1)
    ref = DecoderLM.open(inspect_folder(plain), "onnxruntime", options)
    lm = DecoderLM.open(inspect_folder(converted[0]), "onnxruntime", options)
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0)).start()
    try:
        assert isinstance(sched._batch, SlotCache)  # served with the in-place buffers
        handles = [sched.submit(p, SamplingParams(max_new_tokens=STEPS, ignore_eos=True)) for p in PROMPTS]
        for prompt, handle in zip(PROMPTS, handles):
            want = list(ref.generate_greedy(prompt, STEPS, stop_at_eos=False))
            assert list(handle.result(60).token_ids) == want
    finally:
        sched.stop()
        lm.close()
        ref.close()


def test_prompts_ask_the_converted_graph_for_the_last_position_only(plain, converted):
    import onnxruntime as ort

    cfg = json.loads((plain / "config.json").read_text())
    every = _bare_steps(converted[0], cfg, PROMPTS[0], 0, positions=False)[0]  # logits_to_keep left at 0
    sess = ort.InferenceSession(str(converted[0] / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.asarray([PROMPTS[0]], np.int64)
    past = {i.name: np.zeros((1, TINY.kv_heads, 0, TINY.head_dim), np.float32) for i in sess.get_inputs()[2:]}
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "logits_to_keep": np.array(1, np.int64), **past}
    (last,) = sess.run(["logits"], feeds)
    assert last.shape == (1, 1, every.shape[-1])
    np.testing.assert_allclose(last[0, 0], every[-1], rtol=0, atol=1e-5)
    lm = DecoderLM.open(inspect_folder(converted[0]), "onnxruntime", SessionOptions(threads=1))
    try:
        assert lm._slot_runs.last_only  # as served: the head runs on one position per prompt
    finally:
        lm.close()


MISSTATED = {
    "local RoPE base": {"rope_local_base_freq": 1_000_000.0},
    "layer pattern": {"layer_types": ["sliding_attention"] * 7},
    "attention scale": {"query_pre_attn_scalar": 64},
    "window": {"sliding_window": 6},
}


@pytest.mark.parametrize("what", sorted(MISSTATED))
def test_a_config_that_misstates_gemma3_is_refused_by_the_check(what, plain, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(plain, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **MISSTATED[what]}))
    with pytest.raises(InplaceCheckFailed, match="differs from the source"):
        convert_inplace(src, tmp_path / "out", check_tokens=STEPS)


def test_without_its_q_norm_nodes_the_conversion_names_the_module(plain, tmp_path):
    import onnx

    src = tmp_path / "src"
    shutil.copytree(plain, src)
    model = onnx.load(str(src / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.name.startswith("/model/layers.2/self_attn/q_norm/"):
            node.name = node.name.replace("/q_norm/", "/renamed/")
    onnx.save(model, str(src / "model.onnx"))
    with pytest.raises(Exception, match=r"no weight for module layers\.2\.self_attn\.q_norm"):
        convert_inplace(src, tmp_path / "out", check_tokens=0)


def test_a_multimodal_gemma3_config_is_read_from_its_text_config(plain, tmp_path):
    cfg = json.loads((plain / "config.json").read_text())
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": cfg}))
    assert replace(read_arch(nested), family="gemma3_text") == read_arch(plain)


@pytest.mark.slow
def test_the_real_gemma3_converts_and_its_greedy_tokens_equal_the_reference(gemma3_model, tmp_path):
    """The real Gemma 3 270M: the conversion's own check passes, and 40 greedy tokens of the in-place
    form (through the serving adapter's join/decode) equal transformers' on each prompt, text600's
    decode steps running past the 512-token window."""
    report = convert_inplace(gemma3_model, tmp_path / "inplace", check_tokens=16, threads=2)
    assert report["check"]["greedy_equal"]
    data = np.load(REPO / "tests" / "data" / "gemma3" / "reference.npz")
    lm = DecoderLM.open(inspect_folder(tmp_path / "inplace"), "onnxruntime", SessionOptions(threads=2))
    try:
        for label in ("water", "capital", "text120", "text600"):
            ids, want = data[f"{label}_ids"].tolist(), data[f"{label}_greedy"].tolist()
            cache = lm.new_batch(1)
            logits = lm.join(cache, [label], [ids], reach=[len(ids) + len(want)])
            got = []
            for _ in range(len(want)):
                got.append(int(logits[0].argmax()))
                logits = lm.decode(cache, [got[-1]])
            assert got == want, label
        assert len(data["text600_ids"]) + len(data["text600_greedy"]) > 512 + 32
    finally:
        lm.close()
