"""In-place KV conversion of the plain demo exports: logits against the plain graph on the bare runtime
(numpy), greedy tokens through the agent's scheduler against DecoderLM on the plain folder, and clear
refusals of what cannot be converted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_agent.backends import SessionOptions
from edge_agent.engines.inplace_kv import InplaceCheckFailed, convert_inplace, layout_for
from edge_agent.errors import ModelError
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.kv_slots import SlotCache
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

FAST = ["demo-phi3", "demo-gemma", "demo-gemma2"]
ALL = [*FAST, "demo-phi3-small"]  # materializing demo-phi3-small's weights: about 8 s


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path / "model.onnx"), so, providers=["CPUExecutionProvider"])


def _past(sess: ort.InferenceSession, cfg: dict) -> dict[str, np.ndarray]:
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return {i.name: np.zeros((1, heads, 0, dim), np.float32) for i in sess.get_inputs() if "past" in i.name}


def _bare_steps(path: Path, cfg: dict, prompt: list[int], steps: int, positions: bool) -> list[np.ndarray]:
    """Logits [S, V] of the prefill, then of each teacher-forced greedy step, on the bare runtime."""
    sess = _session(path)
    names = [o.name for o in sess.get_outputs()]
    ids = np.asarray([prompt], np.int64)
    feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": np.ones_like(ids), **_past(sess, cfg)}
    out = []
    for _ in range(steps + 1):
        if positions:
            total = feeds["attention_mask"].shape[1]
            feeds["position_ids"] = np.arange(total - feeds["input_ids"].shape[1], total, dtype=np.int64)[None]
        res = dict(zip(names, sess.run(None, feeds)))
        out.append(res["logits"][0])
        token = int(res["logits"][0, -1].argmax())
        feeds["input_ids"] = np.asarray([[token]], np.int64)
        feeds["attention_mask"] = np.ones((1, feeds["attention_mask"].shape[1] + 1), np.int64)
        for name in names:
            if name.startswith("present."):
                feeds[name.replace("present.", "past_key_values.")] = res[name]
    return out


@pytest.mark.parametrize("name", ALL)
def test_converted_logits_match_the_plain_export_on_the_bare_runtime(name, models_dir, tmp_path):
    src = resolve_model(name, models_dir)
    report = convert_inplace(src.path, tmp_path / "inplace", check_tokens=0)
    assert (tmp_path / "inplace" / "genai_config.json").is_file()
    prompt = list(range(5, 17))  # 12 tokens: with 16 decode steps Gemma-2's window of 16 is passed
    ref = _bare_steps(src.path, src.config, prompt, 16, positions=True)
    got = _bare_steps(tmp_path / "inplace", src.config, prompt, 16, positions=False)
    for step, (r, g) in enumerate(zip(ref, got)):
        scale = max(1.0, float(np.abs(r).max()))
        assert np.abs(r - g).max() <= 1e-4 * scale, (name, step, report)
        assert (r.argmax(-1) == g.argmax(-1)).all(), (name, step)


@pytest.mark.parametrize("name", ALL)
def test_scheduler_on_the_converted_folder_greedy_equals_decoderlm_on_the_plain_one(name, models_dir, tmp_path):
    src = resolve_model(name, models_dir)
    convert_inplace(src.path, tmp_path / "inplace", check_tokens=4)
    options = SessionOptions(threads=1)
    plain = DecoderLM.open(src, "onnxruntime", options)
    lm = DecoderLM.open(inspect_folder(tmp_path / "inplace", name=name), "onnxruntime", options)
    prompts = [list(range(7, 19)), list(range(40, 47))]
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0)).start()
    try:
        assert isinstance(sched._batch, SlotCache)  # served with the in-place buffers
        assert lm.full_width_mask  # and decode steps that bind their mask once, at the full KV width
        handles = [sched.submit(p, SamplingParams(max_new_tokens=16, ignore_eos=True)) for p in prompts]
        for prompt, handle in zip(prompts, handles):
            want = list(plain.generate_greedy(prompt, 16, stop_at_eos=False))
            assert list(handle.result(60).token_ids) == want
    finally:
        sched.stop()
        lm.close()
        plain.close()


@pytest.mark.parametrize("name", ["demo-phi3", "demo-gemma2"])
def test_decode_steps_of_two_rows_match_the_bare_plain_export_step_by_step(name, models_dir, tmp_path):
    src = resolve_model(name, models_dir)
    convert_inplace(src.path, tmp_path / "inplace", check_tokens=0)
    lm = DecoderLM.open(inspect_folder(tmp_path / "inplace", name=name), "onnxruntime", SessionOptions(threads=1))
    try:
        assert lm.full_width_mask
        prompts = [list(range(5, 17)), list(range(30, 35))]  # 12 and 5 tokens: rows of different lengths
        refs = [_bare_steps(src.path, src.config, p, 16, positions=True) for p in prompts]
        cache = lm.new_batch(2)
        logits = lm.join(cache, ["a", "b"], prompts)
        returned = []
        for step in range(17):
            for row, ref in enumerate(refs):
                want = ref[step][-1]
                scale = max(1.0, float(np.abs(want).max()))
                assert np.abs(logits[row] - want).max() <= 1e-4 * scale, (name, step, row)
            returned.append((logits, logits.copy()))
            if step < 16:
                logits = lm.decode(cache, [int(r[step][-1].argmax()) for r in refs])
        # each step's logits are the caller's own: later steps never write into them
        assert all(np.array_equal(kept, copy) for kept, copy in returned)
    finally:
        lm.close()


def test_a_newcomer_that_reaches_further_grows_the_buffers_under_a_running_stream(models_dir, tmp_path):
    src = resolve_model("demo-phi3", models_dir)
    convert_inplace(src.path, tmp_path / "inplace", check_tokens=0)
    options = SessionOptions(threads=1)
    plain = DecoderLM.open(src, "onnxruntime", options)
    lm = DecoderLM.open(inspect_folder(tmp_path / "inplace", name="demo-phi3"), "onnxruntime", options)
    sched = LLMScheduler(lm, Limits(max_batch=2, batch_timeout_ms=0)).start()
    try:
        short, long = list(range(7, 19)), [int(x) for x in np.random.default_rng(3).integers(5, 900, 300)]
        first = sched.submit(short, SamplingParams(max_new_tokens=40, ignore_eos=True))
        events = iter(first)
        next(events)  # it decodes in a 256-token cache
        assert sched._batch.capacity == 256
        second = sched.submit(long, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert list(second.result(60).token_ids) == list(plain.generate_greedy(long, 24, stop_at_eos=False))
        assert sched._batch.capacity == 512  # 300 + 24 tokens: grown, the first row's cache copied along
        assert list(first.result(60).token_ids) == list(plain.generate_greedy(short, 40, stop_at_eos=False))
    finally:
        sched.stop()
        lm.close()
        plain.close()


def test_a_graph_that_reads_the_mask_width_keeps_exact_width_masks(models_dir, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    src = resolve_model("demo-phi3", models_dir)
    out = tmp_path / "inplace"
    convert_inplace(src.path, out, check_tokens=0)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    g = model.graph
    (last,) = [n for n in g.node if "logits" in n.output]
    last.output[list(last.output).index("logits")] = "logits_before"
    g.initializer.extend(
        [
            helper.make_tensor("width_index", TensorProto.INT64, [], [1]),
            helper.make_tensor("width_scale", TensorProto.FLOAT, [], [1e-3]),
        ]
    )
    g.node.extend(
        [  # logits + 1e-3 * mask width: the same argmax, other logits at another width
            helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
            helper.make_node("Gather", ["mask_shape", "width_index"], ["width"], axis=0),
            helper.make_node("Cast", ["width"], ["width_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["width_f", "width_scale"], ["shift"]),
            helper.make_node("Add", ["logits_before", "shift"], ["logits"]),
        ]
    )
    onnx.save(model, str(out / "model.onnx"))
    plain = DecoderLM.open(src, "onnxruntime", SessionOptions(threads=1))
    lm = DecoderLM.open(inspect_folder(out, name="demo-phi3"), "onnxruntime", SessionOptions(threads=1))
    try:
        assert not lm.full_width_mask
        cache = lm.new_batch(1)
        prompt = list(range(7, 19))
        logits = lm.join(cache, [0], [prompt])
        got = []
        for _ in range(8):
            got.append(int(logits[0].argmax()))
            logits = lm.decode(cache, [got[-1]])
        assert got == list(plain.generate_greedy(prompt, 8, stop_at_eos=False, known_only=False))
    finally:
        lm.close()
        plain.close()


def test_a_corrupted_weight_is_refused_by_the_check(tmp_path):
    import onnx

    src = tmp_path / "src"
    shutil.copytree(resolve_model("demo-gemma", tmp_path).path, src)
    model = onnx.load(str(src / "model.onnx"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5  # the graph keeps 1e-6: the rebuilt norms differ
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InplaceCheckFailed, match="differs from the source at prefill"):
        convert_inplace(src, tmp_path / "out")
    # a graph without its o_proj weights: the error names the module
    for node in model.graph.node:
        if node.name.endswith("layers.1/self_attn/o_proj/MatMul"):
            node.name = "/renamed/MatMul"
    onnx.save(model, str(src / "model.onnx"))
    cfg["rms_norm_eps"] = 1e-6
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"no weight for module layers\.1\.self_attn\.o_proj"):
        convert_inplace(src, tmp_path / "out")


def test_unsupported_rope_scaling_and_bad_files_are_refused_naming_what(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(resolve_model("demo-phi3", tmp_path).path, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "longrope"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"rope_parameters\.rope_type = 'longrope'"):
        convert_inplace(src, tmp_path / "out")
    cfg["rope_parameters"]["rope_type"] = "default"
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="model_type 'llama'"):
        convert_inplace(src, tmp_path / "out")
    cfg["model_type"] = "phi3"
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelError, match=r"model\.onnx: not a readable ONNX model"):
        convert_inplace(src, tmp_path / "out")


def test_layout_applies_to_weight_only_onnxruntime_builds_of_plain_exports(tmp_path):
    plain = resolve_model("demo-phi3", tmp_path).path
    args = ("llm", plain, "model.onnx")
    assert layout_for("inplace", *args, "onnxruntime", "fp32", "") == "inplace-kv"
    assert layout_for("inplace", *args, "onnxruntime", "int4", "") == "inplace-kv"
    assert layout_for("inplace", *args, "onnxruntime", "int8", "dynamic") == "inplace-kv"
    assert layout_for("inplace", *args, "onnxruntime", "int8", "qdq") == ""
    assert layout_for("inplace", *args, "onnxruntime", "fp16", "") == ""
    assert layout_for("inplace", *args, "openvino", "fp32", "") == ""
    assert layout_for("plain", *args, "onnxruntime", "fp32", "") == ""
