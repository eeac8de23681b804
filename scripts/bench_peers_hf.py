"""Rebuild a Hugging Face Phi-3 checkpoint from a plain ONNX export, for the peers of scripts/bench-peers.

OpenVINO GenAI (through ``optimum-cli export openvino``) and llama.cpp (through ``convert_hf_to_gguf.py``)
start from a Hugging Face checkpoint. This writes one with the ONNX export's own weights
(``make_genai_model.hf_state_dict``), checks that it reproduces the ONNX model's logits, and saves it as
safetensors with the export's config and tokenizer files. Runs in the exporter environment (.venv-export).

    .venv-export/bin/python scripts/bench_peers_hf.py SRC_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from make_genai_model import TOKENIZER_FILES, hf_state_dict
from transformers import Phi3Config, Phi3ForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="plain export: model.onnx (+ .data), config.json, tokenizer")
    parser.add_argument("out", type=Path, help="checkpoint folder to write (replaced)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    config = Phi3Config.from_pretrained(args.src)
    model = Phi3ForCausalLM(config).eval()
    state = hf_state_dict(onnx.load(str(args.src / "model.onnx")))
    unknown = [k for k in model.state_dict() if k not in state and not k.endswith("norm.weight")]
    if unknown:
        sys.exit(f"bench_peers_hf: no ONNX initializer for {unknown[:5]} (is {args.src} a plain Phi-3 export?)")
    model.load_state_dict(state, strict=False)
    del state

    prompt = np.arange(5, 37, dtype=np.int64)[None]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(str(args.src / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": prompt,
        "attention_mask": np.ones_like(prompt),
        "position_ids": np.arange(prompt.shape[1], dtype=np.int64)[None],
    }
    head_dim = config.hidden_size // config.num_attention_heads
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values"):
            feeds[spec.name] = np.zeros((1, config.num_key_value_heads, 0, head_dim), np.float32)
    onnx_logits = session.run(["logits"], feeds)[0][0]
    del session
    with torch.no_grad():
        hf_logits = model(torch.from_numpy(prompt)).logits[0].numpy()
    err = float(np.abs(onnx_logits - hf_logits).max())
    if err > 1e-3:
        sys.exit(f"bench_peers_hf: rebuilt checkpoint differs from the ONNX model (max |Δlogit| {err:.2e})")

    shutil.rmtree(args.out, ignore_errors=True)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.src / name).is_file():
            shutil.copy(args.src / name, args.out / name)
    print(f"wrote {args.out}: checkpoint of {args.src.name}, max |Δlogit| vs ONNX {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
