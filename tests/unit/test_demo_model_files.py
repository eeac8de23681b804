"""The committed demo models (edge_agent/demo_models) are complete and consistent.

Torch-free: numpy, onnxruntime and json only. Besides the files and I/O contracts, the ONNX graphs are
run against the PyTorch references stored next to them (reference.npz), the way the runtime drives them:
KV-cache decode loops, left-padded batches with position_ids = cumsum(mask) - 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from edge_agent.demo_models import materialize as mat  # noqa: E402  (after the importorskip)

ROOT = Path(__file__).resolve().parents[2] / "edge_agent" / "demo_models"
LLMS = ("demo-phi3", "demo-gemma", "demo-gemma2")
COMMON = {"config.json", "io_contract.json", "generator.json"}
LLM_FILES = COMMON | {
    "model.onnx",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}
EXPECTED = {
    **{name: LLM_FILES | {"reference.npz"} for name in LLMS},
    "demo-phi3-small": LLM_FILES | {"weights.json"},
    "demo-whisper": COMMON
    | {
        "encoder_model.onnx",
        "decoder_model.onnx",
        "decoder_with_past_model.onnx",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "reference.npz",
    },
    "demo-ctc": COMMON | {"model.onnx", "vocab.json", "preprocessor_config.json", "reference.npz"},
}
ORT_TYPES = {"tensor(float)": "float32", "tensor(int64)": "int64"}


def load_json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def session(path: Path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def assert_close(got: np.ndarray, want: np.ndarray, tol: float = 1e-4) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol * max(1.0, float(np.abs(want).max()))


def check_contract(folder: Path, contract: dict) -> None:
    for file, io in contract.items():
        sess = session(folder / file)
        for want, got in ((io["inputs"], sess.get_inputs()), (io["outputs"], sess.get_outputs())):
            assert [(a.name, ORT_TYPES[a.type], list(a.shape)) for a in got] == [
                (w["name"], w["dtype"], w["shape"]) for w in want
            ], f"{folder.name}/{file}"


def tokenizer_vocab(folder: Path) -> dict[str, int]:
    tok = load_json(folder / "tokenizer.json")
    return {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_folder_is_complete(name: str) -> None:
    folder = ROOT / name
    files = {p.name for p in folder.iterdir()}
    assert EXPECTED[name] <= files, EXPECTED[name] - files
    contract = load_json(folder / "io_contract.json")
    assert set(contract) == {f for f in files if f.endswith(".onnx")}
    assert "model.onnx.data" not in files  # demo-phi3-small's weights are never committed
    assert load_json(folder / "generator.json")["model"] == name


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - {"demo-phi3-small"}))
def test_io_contract_matches_onnx(name: str) -> None:
    check_contract(ROOT / name, load_json(ROOT / name / "io_contract.json"))


@pytest.mark.parametrize("name", (*LLMS, "demo-phi3-small"))
def test_llm_metadata(name: str) -> None:
    folder = ROOT / name
    config, gen = load_json(folder / "config.json"), load_json(folder / "generation_config.json")
    tok_config, vocab = load_json(folder / "tokenizer_config.json"), tokenizer_vocab(folder)
    assert config["vocab_size"] >= len(vocab)  # padded like Phi-3's 32064
    assert "<|assistant|>" in tok_config["chat_template"] or "<start_of_turn>" in tok_config["chat_template"]
    for key in ("bos", "eos", "pad"):
        assert tok_config[f"{key}_token"] in vocab
    assert gen["bos_token_id"] == vocab[tok_config["bos_token"]]
    assert vocab[tok_config["eos_token"]] in gen["eos_token_id"]
    stop = "<|end|>" if config["model_type"] == "phi3" else "<end_of_turn>"
    assert vocab[stop] in gen["eos_token_id"]


def llm_greedy(sess, config: dict, prompts: list[list[int]], n_new: int, pad: int) -> np.ndarray:
    """Left-padded batch, KV cache through present -> past_key_values, position_ids = cumsum(mask) - 1."""
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = max(map(len, prompts))
    ids = np.array([[pad] * (width - len(p)) + p for p in prompts], np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], np.int64)
    feeds = {
        f"past_key_values.{i}.{kv}": np.zeros((len(prompts), kv_heads, 0, head_dim), np.float32)
        for i in range(layers)
        for kv in ("key", "value")
    }
    new = []
    for _ in range(n_new):
        positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)[:, -ids.shape[1] :]
        out = run(sess, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **feeds})
        ids = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        new.append(ids[:, 0])
        mask = np.concatenate([mask, np.ones_like(ids)], 1)
        feeds = {k.replace("present", "past_key_values"): v for k, v in out.items() if k != "logits"}
    return np.stack(new, 1)


@pytest.mark.parametrize("name", LLMS)
def test_llm_matches_torch_reference(name: str) -> None:
    folder = ROOT / name
    ref, config = np.load(folder / "reference.npz"), load_json(folder / "config.json")
    sess, pad = session(folder / "model.onnx"), config["pad_token_id"]
    prompt, prompt2 = ref["prompt_ids"].tolist(), ref["prompt2_ids"].tolist()
    first = llm_greedy(sess, config, [prompt], 1, pad)  # also checks that an empty past works
    assert first[0, 0] == ref["greedy_ids"][0]
    n = len(prompt)
    feeds = {
        "input_ids": ref["prompt_ids"][None],
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    feeds.update(
        {
            i.name: np.zeros((1, config["num_key_value_heads"], 0, head_dim), np.float32)
            for i in sess.get_inputs()
            if i.name.startswith("past_key_values")
        }
    )
    assert_close(run(sess, feeds)["logits"][0], ref["prompt_logits"])
    n_new = len(ref["greedy_ids"])
    assert (llm_greedy(sess, config, [prompt], n_new, pad)[0] == ref["greedy_ids"]).all()
    batched = llm_greedy(sess, config, [prompt, prompt2], n_new, pad)
    assert (batched == np.stack([ref["greedy_ids"], ref["greedy2_ids"]])).all()


def test_whisper_matches_torch_reference() -> None:
    folder = ROOT / "demo-whisper"
    ref, config = np.load(folder / "reference.npz"), load_json(folder / "config.json")
    gen, pre = load_json(folder / "generation_config.json"), load_json(folder / "preprocessor_config.json")
    vocab = tokenizer_vocab(folder)
    assert config["vocab_size"] == len(vocab) and vocab["<|30.00|>"] == len(vocab) - 1
    assert vocab["<|notimestamps|>"] + 1 == vocab["<|0.00|>"] == gen["no_timestamps_token_id"] + 1
    assert gen["decoder_start_token_id"] == vocab["<|startoftranscript|>"] == ref["decoder_prompt_ids"][0]
    assert (pre["feature_size"], pre["nb_max_frames"], pre["n_samples"]) == (80, 3000, 480000)
    assert ref["input_features"].shape == (80, 3000)

    enc = run(session(folder / "encoder_model.onnx"), {"input_features": ref["input_features"][None]})
    assert_close(enc["last_hidden_state"][0], ref["encoder_hidden_states"])
    out = run(
        session(folder / "decoder_model.onnx"),
        {"input_ids": ref["decoder_prompt_ids"][None], "encoder_hidden_states": enc["last_hidden_state"]},
    )
    tokens = [int(out["logits"][0, -1].argmax())]
    past = {k.replace("present", "past_key_values"): v for k, v in out.items() if k != "logits"}
    step = session(folder / "decoder_with_past_model.onnx")
    while len(tokens) < len(ref["greedy_ids"]):
        out = run(step, {"input_ids": np.array([[tokens[-1]]], np.int64), **past})
        tokens.append(int(out["logits"][0, -1].argmax()))
        past.update({k.replace("present", "past_key_values"): v for k, v in out.items() if k != "logits"})
    assert tokens == ref["greedy_ids"].tolist()


def test_ctc_matches_torch_reference() -> None:
    folder = ROOT / "demo-ctc"
    ref, config, vocab = (
        np.load(folder / "reference.npz"),
        load_json(folder / "config.json"),
        load_json(folder / "vocab.json"),
    )
    assert config["vocab_size"] == len(vocab) and vocab["<pad>"] == config["pad_token_id"] == 0 and "|" in vocab
    wave = ref["waveform"]
    assert_close(ref["input_values"], (wave - wave.mean()) / np.sqrt(wave.var() + 1e-7), 1e-5)
    logits = run(session(folder / "model.onnx"), {"input_values": ref["input_values"][None]})["logits"][0]
    assert logits.shape[0] == len(wave) // 320 - 1
    assert_close(logits, ref["logits"])
    assert (logits.argmax(-1) == ref["greedy_ids"]).all()


def test_phi3_small_materializes_and_runs(tmp_path: Path) -> None:
    src, dst = ROOT / "demo-phi3-small", tmp_path / "demo-phi3-small"
    recipe = mat.load_recipe(src)
    calls: list[tuple[int, int]] = []
    assert mat.materialize(src, dst, progress=lambda done, total: calls.append((done, total))) == dst
    assert calls[-1] == (recipe["data_bytes"], recipe["data_bytes"])
    assert (dst / "model.onnx.data").stat().st_size == recipe["data_bytes"]
    assert mat.is_materialized(src, dst)
    check_contract(dst, load_json(dst / "io_contract.json"))
    config = load_json(dst / "config.json")
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (512, 6, 8000)
    sess = session(dst / "model.onnx")
    ids = np.array([[1, 20, 300, 400, 500]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(5)[None]}
    feeds.update({i.name: np.zeros((1, 8, 0, 64), np.float32) for i in sess.get_inputs()[3:]})
    out = run(sess, feeds)
    assert out["logits"].shape == (1, 5, 8000) and np.isfinite(out["logits"]).all()
    assert out["present.5.value"].shape == (1, 8, 5, 64)


def test_materialize_rejects_a_wrong_recipe(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    tensors = [
        {
            "name": "a",
            "offset": 0,
            "length": 24,
            "dtype": "float32",
            "shape": [2, 3],
            "init": "normal",
            "std": 0.02,
            "seed": 7,
        },
        {"name": "b", "offset": 64, "length": 16, "dtype": "float32", "shape": [4], "init": "ones"},
    ]
    recipe = {"format": 1, "file": "model.onnx.data", "data_bytes": 80, "data_sha256": None, "tensors": tensors}
    recipe["data_sha256"] = mat.recipe_sha256(recipe)
    (src / "weights.json").write_text(json.dumps(recipe))
    (src / "model.onnx").write_bytes(b"graph")
    data = (mat.materialize(src, tmp_path / "ok") / "model.onnx.data").read_bytes()
    want = np.random.default_rng(7).standard_normal((2, 3), dtype=np.float32) * np.float32(0.02)
    assert data[:24] == want.tobytes() and data[24:64] == bytes(40) and data[64:] == np.ones(4, np.float32).tobytes()

    tensors[0]["seed"] = 8
    (src / "weights.json").write_text(json.dumps(recipe))
    with pytest.raises(ValueError, match="do not match"):
        mat.materialize(src, tmp_path / "bad")
    assert not any((tmp_path / "bad").iterdir())  # nothing half-written is left behind
    shutil.rmtree(tmp_path / "bad")
