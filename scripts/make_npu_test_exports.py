"""Export tiny random-weight Phi-3 and Gemma-2 models with optimum's ONNX exporter, as NPU test fixtures.

The demo models (scripts/make_demo_models.py) are exported with torch.onnx.export. Users' exports come
from ``optimum-cli export onnx --task text-generation-with-past``, whose graphs differ (how the causal
mask, the sliding window and the past length are computed). This script makes such exports from real
Hugging Face architectures with fixed seeds, so the NPU path (edge_agent/backends/openvino_stateful.py)
is tested on them (tests/integration/test_npu_exports.py):

- phi3-optimum-tiny:  Phi-3, 4 heads, 4 KV heads;
- phi3-gqa-tiny:      Phi-3 with grouped-query attention, 8 heads, 2 KV heads;
- gemma2-optimum-tiny: Gemma-2, sliding window of 16 tokens on its first layer (narrower than the
  tests' NPU cache of 127 tokens), logit soft-capping.

Each is saved as a Hugging Face checkpoint (the demo models' tokenizer files), exported with
optimum-cli, checked against PyTorch on ONNX Runtime (prompt logits and greedy tokens for the tests'
prompts, with every greedy step clear of a near-tie), and written to tests/data/<name>/.

Runs in its own export environment, never imported by the package or the tests:
    python3.11 -m venv /tmp/exportenv
    /tmp/exportenv/bin/pip install torch==2.13.0 optimum-onnx==0.1.0 onnxruntime==1.32.0
(optimum-onnx 0.1.0 pins transformers<4.58: it brings transformers 4.57.x and optimum 2.1.0).
Usage: /tmp/exportenv/bin/python scripts/make_npu_test_exports.py [--out DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import transformers
from transformers import Gemma2Config, Gemma2ForCausalLM, Phi3Config, Phi3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data"
DEMO = ROOT / "edge_agent" / "demo_models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 1024  # the model's logits; the demo tokenizers have 1000 entries
TOKENIZER_SIZE = 1000
# The prompts tests/integration/test_npu_exports.py runs: (length, seed) of random ids in [3, 1000),
# and how many greedy tokens follow. 90 is longer than the tests' compiled NPU prompt (64 tokens).
PROMPTS = ((6, 0), (90, 1))
N_NEW = 32
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit at every greedy step: runtimes differ from torch by ~1e-6

PHI3 = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 995,
    "pad_token_id": 995,
}
GEMMA2 = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 16,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192,
    "initializer_range": 0.02,
    "bos_token_id": 2,
    "eos_token_id": [1, 5],
    "pad_token_id": 0,
}
MODELS: dict[str, dict[str, Any]] = {
    "phi3-optimum-tiny": {
        "cls": Phi3ForCausalLM,
        "config": Phi3Config(**PHI3, num_attention_heads=4, num_key_value_heads=4),
        "tokenizer": "demo-phi3",
        "seed": 4101,
    },
    "phi3-gqa-tiny": {
        "cls": Phi3ForCausalLM,
        "config": Phi3Config(**PHI3, num_attention_heads=8, num_key_value_heads=2),
        "tokenizer": "demo-phi3",
        "seed": 4102,
    },
    "gemma2-optimum-tiny": {
        "cls": Gemma2ForCausalLM,
        "config": Gemma2Config(**GEMMA2),
        "tokenizer": "demo-gemma2",
        "seed": 4103,
    },
}


def test_prompts() -> list[list[int]]:
    return [[int(t) for t in np.random.default_rng(seed).integers(3, TOKENIZER_SIZE, n)] for n, seed in PROMPTS]


def torch_greedy(model: torch.nn.Module, prompt: list[int], n_new: int) -> tuple[np.ndarray, list[int], float]:
    """Prompt logits, then n_new argmax tokens by full forward passes (no cache), and the smallest
    top-1/top-2 margin on the way (over the tokenizer's ids: the agent never samples past them)."""
    ids = list(prompt)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        tokens, margin = [], float("inf")
        for step in range(n_new):
            last = logits[-1] if step == 0 else model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
            top2 = np.sort(last[:TOKENIZER_SIZE])[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            tokens.append(int(last[:TOKENIZER_SIZE].argmax()))
            ids.append(tokens[-1])
    return logits, tokens, margin


def ort_greedy(path: Path, config: Any, prompt: list[int], n_new: int) -> tuple[np.ndarray, list[int]]:
    """The exported graph through its past/present contract, one sequence, as the agent feeds it."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    kv_heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    feeds = {n: np.zeros((1, kv_heads, 0, dim), np.float32) for n in names if n.startswith("past_key_values.")}
    ids, length, tokens, first = np.array([prompt], np.int64), 0, [], None
    for _ in range(n_new):
        n = ids.shape[1]
        feeds.update(
            input_ids=ids,
            attention_mask=np.ones((1, length + n), np.int64),
            position_ids=np.arange(length, length + n, dtype=np.int64)[None],
        )
        feeds = {k: v for k, v in feeds.items() if k in names}  # optimum's Gemma-2 export has no position_ids
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        first = out["logits"][0] if first is None else first
        tokens.append(int(out["logits"][0, -1, :TOKENIZER_SIZE].argmax()))
        ids, length = np.array([[tokens[-1]]], np.int64), length + n
        feeds = {k.replace("present.", "past_key_values."): v for k, v in out.items() if k.startswith("present.")}
    return first, tokens


def export(name: str, out_dir: Path) -> dict[str, Any]:
    spec = MODELS[name]
    torch.manual_seed(spec["seed"])
    model = spec["cls"](spec["config"]).eval()
    prompts = test_prompts()
    refs = [torch_greedy(model, p, N_NEW) for p in prompts]
    margin = min(r[2] for r in refs)
    assert margin > MIN_MARGIN, f"{name}: a greedy step is a near-tie ({margin:.2g}); pick another seed"
    if spec["config"].model_type == "gemma2":  # the tokens must depend on the window, or it is not tested
        wide = spec["cls"](Gemma2Config(**{**GEMMA2, "sliding_window": 4096})).eval()
        wide.load_state_dict(model.state_dict())
        assert torch_greedy(wide, prompts[1], N_NEW)[1] != refs[1][1], f"{name}: the window changes nothing"

    folder = out_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        model.save_pretrained(checkpoint)
        for file in (*TOKENIZER_FILES, "generation_config.json"):
            shutil.copy(DEMO / spec["tokenizer"] / file, checkpoint / file)
        command = [
            str(Path(sys.executable).parent / "optimum-cli"),
            "export",
            "onnx",
            "--model",
            str(checkpoint),
            "--task",
            "text-generation-with-past",
            str(folder),
        ]
        subprocess.run(command, check=True)
    for file in TOKENIZER_FILES:  # the demo's own files, whatever optimum re-saved
        shutil.copy(DEMO / spec["tokenizer"] / file, folder / file)

    for prompt, (logits, tokens, _) in zip(prompts, refs):
        got_logits, got_tokens = ort_greedy(folder / "model.onnx", model.config, prompt, N_NEW)
        err = float(np.abs(got_logits - logits).max())
        assert err < 1e-4 * max(1.0, float(np.abs(logits).max())), f"{name}: prompt logits differ by {err:.3g}"
        assert got_tokens == tokens, f"{name}: ONNX Runtime's greedy tokens differ from torch's"

    versions = {p: version(p) for p in ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime")}
    shape = {k: getattr(model.config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    shape.update(kv_heads=model.config.num_key_value_heads, vocab=VOCAB, window=model.config.sliding_window)
    size = sum(f.stat().st_size for f in folder.iterdir())
    (folder / "README.md").write_text(
        f"{name}: random weights (torch.manual_seed({spec['seed']})), {type(model).__name__} "
        f"{json.dumps(shape)}, tokenizer of {spec['tokenizer']}; exported by "
        f"`optimum-cli export onnx --task text-generation-with-past` ("
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + "), made by scripts/make_npu_test_exports.py.\n"
    )
    return {
        "min_margin": round(margin, 4),
        "tokens": [r[1][:8] for r in refs],
        "bytes": size,
        "files": sorted(f.name for f in folder.iterdir()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    for name in args.only:
        print(f"{name}: exporting", flush=True)
        print(f"{name}: ok {json.dumps(export(name, args.out))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
