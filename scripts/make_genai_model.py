"""Build an onnxruntime-genai folder of a plain ONNX Phi-3 export, with the same weights.

Used for the LLM benchmark's side-by-side comparison with onnxruntime-genai's generator. The plain
export (``torch.onnx.export`` of Phi3ForCausalLM, as scripts/make_demo_models.py makes it) keeps
the embedding under its parameter name and every Linear as a transposed ``MatMul`` initializer whose
consumer node is named after the module; RMSNorm weights are the exporter's shared ones. From those
the HF checkpoint is rebuilt, checked against the ONNX logits, and handed to
``onnxruntime_genai.models.builder`` (GroupQueryAttention, ``genai_config.json``).

Runs in the exporter environment (torch, transformers, onnx, onnxruntime-genai, onnx-ir):
    scripts/make-genai-model SRC_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from transformers import Phi3Config, Phi3ForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def hf_state_dict(graph: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """HF parameter name -> tensor, recovered from the plain export's initializers."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    state: dict[str, torch.Tensor] = {}
    for init in graph.graph.initializer:
        value = numpy_helper.to_array(init)
        if init.name.startswith("model.model.") and init.name.endswith("embed_tokens.weight"):
            state[init.name.removeprefix("model.")] = torch.from_numpy(value.copy())
            continue
        matmuls = [n for n in consumers.get(init.name, []) if n.op_type == "MatMul" and n.input[1] == init.name]
        if not matmuls:
            continue  # norm weights (all ones, shared by the exporter) and constants
        # "/model/model/layers.0/self_attn/qkv_proj/MatMul" -> "model.layers.0.self_attn.qkv_proj.weight"
        module = matmuls[0].name.removeprefix("/model/").rsplit("/", 1)[0].replace("/", ".")
        state[f"{module}.weight"] = torch.from_numpy(value.T.copy())
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="folder with model.onnx (+ model.onnx.data), config.json, tokenizer")
    parser.add_argument("out", type=Path, help="the onnxruntime-genai folder to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    graph = onnx.load(str(args.src / "model.onnx"))
    config = Phi3Config.from_pretrained(args.src)
    model = Phi3ForCausalLM(config).eval()
    state = hf_state_dict(graph)
    missing = [
        k
        for k in model.state_dict()
        if k not in state and not k.endswith("layernorm.weight") and not k.endswith("norm.weight")
    ]
    if missing:
        sys.exit(f"make-genai-model: no ONNX initializer found for {missing[:5]} (is {args.src} a plain Phi-3 export?)")
    model.load_state_dict(state, strict=False)
    del graph

    # The rebuilt checkpoint must reproduce the ONNX model's logits before it is converted.
    prompt = np.arange(5, 37, dtype=np.int64)[None]
    session = ort.InferenceSession(str(args.src / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": prompt,
        "attention_mask": np.ones_like(prompt),
        "position_ids": np.arange(prompt.shape[1], dtype=np.int64)[None],
    }
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values"):
            head_dim = config.hidden_size // config.num_attention_heads
            feeds[spec.name] = np.zeros((1, config.num_key_value_heads, 0, head_dim), np.float32)
    onnx_logits = session.run(["logits"], feeds)[0][0]
    with torch.no_grad():
        hf_logits = model(torch.from_numpy(prompt)).logits[0].numpy()
    err = float(np.abs(onnx_logits - hf_logits).max())
    if err > 1e-3:
        sys.exit(f"make-genai-model: rebuilt checkpoint differs from the ONNX model (max |Δlogit| {err:.2e})")
    print(f"checkpoint rebuilt from {args.src.name}: max |Δlogit| vs ONNX {err:.1e}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, cache = Path(tmp) / "hf", Path(tmp) / "cache"
        model.save_pretrained(hf_dir)
        for name in TOKENIZER_FILES:
            if (args.src / name).is_file():
                shutil.copy(args.src / name, hf_dir / name)
        shutil.rmtree(args.out, ignore_errors=True)
        # The builder's CLI is its stable interface (its Python entry points change between releases).
        subprocess.run(
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-m",
                "phi3-local",
                "-i",
                str(hf_dir),
                "-o",
                str(args.out),
                "-p",
                "fp32",
                "-e",
                "cpu",
                "-c",
                str(cache),
            ],
            check=True,
        )
    for name in TOKENIZER_FILES:
        if (args.src / name).is_file() and not (args.out / name).exists():
            shutil.copy(args.src / name, args.out / name)
    genai = json.loads((args.out / "genai_config.json").read_text())
    print(
        f"wrote {args.out} (genai_config: context {genai['model']['context_length']}, "
        f"{len(list(args.out.iterdir()))} files)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
