"""Each demo model on every installed CPU backend reproduces its PyTorch reference outputs.

The references (``reference.npz``) were computed by PyTorch from the same weights when the demo
models were generated (scripts/make_demo_models.py); this test needs neither torch nor the generator.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, is_installed, open_session
from edge_agent.models.catalog import DEMO_DIR, inspect_folder, resolve_model
from edge_agent.models.llm import DecoderLM

BACKENDS = [b for b in ("onnxruntime", "openvino") if is_installed(b)]
LLMS = ["demo-phi3", "demo-gemma", "demo-gemma2"]
# fp32 on both runtimes; OpenVINO is pinned to f32 by the backend (it would pick bf16 on some CPUs).
OPTIONS = {"onnxruntime": SessionOptions(device="cpu", threads=2), "openvino": SessionOptions(device="CPU", threads=2)}


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DEMO_DIR / name / "reference.npz") as ref:
        return {k: ref[k] for k in ref.files}


def assert_logits_close(got: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, atol=1e-4 * max(scale, 1.0), rtol=1e-4)


# Other folder formats of the same weights, checked against the same PyTorch references:
# an onnxruntime-genai folder (GroupQueryAttention, in-place KV buffers) made from demo-phi3 by
# scripts/make-genai-model, and a stateless OpenVINO IR converted from the ONNX export at test time.
GENAI_PHI3 = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"
FORMATS = [(m, b, "onnx") for m in LLMS for b in BACKENDS] + [("demo-phi3", "onnxruntime", "genai")]
if "openvino" in BACKENDS:
    FORMATS += [("demo-phi3", "openvino", "ir"), ("demo-gemma2", "openvino", "ir")]


def openvino_ir_folder(name: str, out: Path) -> Path:
    import openvino as ov

    src = DEMO_DIR / name
    model = ov.convert_model(str(src / "model.onnx"))
    ov.save_model(model, str(out / "openvino_model.xml"), compress_to_fp16=False)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name not in ("io_contract.json", "generator.json"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module", params=FORMATS, ids=lambda p: "-".join(p))
def llm(request, tmp_path_factory):
    name, backend, form = request.param
    if form == "genai":
        ref = inspect_folder(GENAI_PHI3)
    elif form == "ir":
        ref = inspect_folder(openvino_ir_folder(name, tmp_path_factory.mktemp(f"{name}-ir")))
    else:
        ref = resolve_model(name, tmp_path_factory.mktemp("models"))
    lm = DecoderLM.open(ref, backend, OPTIONS[backend])
    assert lm.ref.model_type == {"genai": "genai", "ir": "openvino-ir"}.get(form, lm.ref.model_type)
    yield name, lm
    lm.close()


def test_llm_prompt_logits_match_pytorch(llm):
    name, lm = llm
    ref = reference(name)
    ids = ref["prompt_ids"][None].astype(np.int64)
    logits, past = lm.forward(ids, np.ones_like(ids), lm._empty_past(1))
    assert_logits_close(logits[0], ref["prompt_logits"])
    assert past["past_key_values.0.key"].shape[2] == ids.shape[1]


@pytest.mark.parametrize("prompt, greedy", [("prompt_ids", "greedy_ids"), ("prompt2_ids", "greedy2_ids")])
def test_llm_greedy_tokens_with_kv_cache_match_pytorch(llm, prompt, greedy):
    name, lm = llm
    ref = reference(name)
    want = ref[greedy].tolist()
    # PyTorch's greedy is over every logit: so is this one (the served default skips unknown ids)
    got = list(lm.generate_greedy(ref[prompt].tolist(), len(want), stop_at_eos=False, known_only=False))
    assert got == want


def test_gemma2_reference_runs_past_its_sliding_window():
    import json

    config = json.loads((DEMO_DIR / "demo-gemma2" / "config.json").read_text())
    ref = reference("demo-gemma2")
    # Otherwise the alternating sliding-window layers would never be exercised by the test above.
    assert len(ref["prompt_ids"]) + len(ref["greedy_ids"]) > config["sliding_window"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctc_logits_match_pytorch(backend):
    ref = reference("demo-ctc")
    session = open_session(DEMO_DIR / "demo-ctc" / "model.onnx", backend, OPTIONS[backend])
    logits = session.run({"input_values": ref["input_values"][None].astype(np.float32)})["logits"][0]
    assert_logits_close(logits, ref["logits"])
    assert logits.argmax(-1).tolist() == ref["greedy_ids"].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_whisper_encoder_and_cached_decoder_match_pytorch(backend):
    ref = reference("demo-whisper")
    folder = DEMO_DIR / "demo-whisper"
    opts = OPTIONS[backend]
    encoder = open_session(folder / "encoder_model.onnx", backend, opts)
    decoder = open_session(folder / "decoder_model.onnx", backend, opts, warmup=lambda s: None)
    with_past = open_session(folder / "decoder_with_past_model.onnx", backend, opts, warmup=lambda s: None)
    hidden = encoder.run({"input_features": ref["input_features"][None].astype(np.float32)})["last_hidden_state"]
    assert_logits_close(hidden[0], ref["encoder_hidden_states"])

    # Greedy decoding: the first pass computes the cross-attention cache, later passes reuse it.
    tokens = ref["decoder_prompt_ids"].astype(np.int64).tolist()
    out = decoder.run({"input_ids": np.asarray([tokens], np.int64), "encoder_hidden_states": hidden})
    generated = []
    past = {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if k.startswith("present.")}
    wanted_past = {s.name for s in with_past.inputs if s.name.startswith("past_key_values.")}
    for step in range(len(ref["greedy_ids"])):
        token = int(out["logits"][0, -1].argmax())
        generated.append(token)
        if step == len(ref["greedy_ids"]) - 1:
            break
        feeds = {"input_ids": np.asarray([[token]], np.int64), **{k: past[k] for k in wanted_past}}
        out = with_past.run(feeds)
        past.update(
            {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if k.startswith("present.")}
        )
    assert generated == ref["greedy_ids"].tolist()


def test_llm_left_padded_batch_equals_single_sequences(llm):
    """Two prompts of different lengths in one batch (left padding) give each one's own logits."""
    name, lm = llm
    if lm.shared_kv:
        pytest.skip("in-place KV folders (GroupQueryAttention) prefill one prompt per slot, never left-padded")
    ref = reference(name)
    a, b = ref["prompt_ids"].tolist(), ref["prompt2_ids"].tolist()
    width = max(len(a), len(b))
    pad = 0
    ids = np.asarray([[pad] * (width - len(p)) + p for p in (a, b)], np.int64)
    mask = np.asarray([[0] * (width - len(p)) + [1] * len(p) for p in (a, b)], np.int64)
    logits, _ = lm.forward(ids, mask, lm._empty_past(2))
    for row, prompt in enumerate((a, b)):
        single, _ = lm.forward(np.asarray([prompt], np.int64), np.ones((1, len(prompt)), np.int64), lm._empty_past(1))
        assert_logits_close(logits[row, -1], single[0, -1])


@pytest.mark.parametrize("join_after", [0, 3, 9])
def test_llm_continuous_batching_matches_single_sequence_references(llm, join_after):
    """Prompt 1 starts alone; prompt 2 joins the running batch after ``join_after`` steps; a third
    copy of prompt 1 joins later still and leaves early. Every row's greedy tokens equal PyTorch's.
    The batch is the model's own kind: a left-padded cache, or in-place slot buffers."""
    name, lm = llm
    ref = reference(name)
    prompts = {"a": ref["prompt_ids"].tolist(), "b": ref["prompt2_ids"].tolist(), "c": ref["prompt_ids"].tolist()}
    wants = {"a": ref["greedy_ids"].tolist(), "b": ref["greedy2_ids"].tolist(), "c": ref["greedy_ids"].tolist()[:5]}
    joins = {0: ["a"], join_after: ["b"], join_after + 4: ["c"]}
    if join_after == 0:
        joins = {0: ["a", "b"], 4: ["c"]}  # a and b prefill together, left-padded
    got: dict[str, list[int]] = {k: [] for k in prompts}
    batch = lm.new_batch(3)
    step = 0
    while step < 100 and (batch.rows or any(s >= step for s in joins)):
        if step in joins:
            rows = joins[step]
            logits = lm.join(batch, rows, [prompts[r] for r in rows])
            for r, row_logits in zip(rows, logits):
                got[r].append(int(row_logits.argmax()))
        done = [i for i, r in enumerate(batch.rows) if len(got[r]) >= len(wants[r])]
        batch.remove(done)
        if batch.rows:
            logits = lm.decode(batch, [got[r][-1] for r in batch.rows])
            for r, row_logits in zip(batch.rows, logits):
                got[r].append(int(row_logits.argmax()))
        step += 1
    for r in prompts:
        assert got[r][: len(wants[r])] == wants[r], f"row {r}"
