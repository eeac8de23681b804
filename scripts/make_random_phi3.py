"""Export a random-weight Phi-3 of a chosen size as a plain ONNX folder, for benchmarks at a realistic size.

The same export path as scripts/make_demo_models.py (``torch.onnx.export`` of ``Phi3ForCausalLM`` with the
flat ``past_key_values.*`` / ``present.*`` I/O, opset 18, checked against PyTorch's logits on ONNX Runtime),
with a configurable size. The default is about 438 M parameters: hidden 1536, 12 layers, 16 heads of 96,
MLP 4096, vocabulary 32,064 (Phi-3-mini's width per head and vocabulary, a quarter of its depth and half its
width). Weights go to ``model.onnx.data``. The tokenizer is a ``tokenizer.json`` given with ``--tokenizer``
(scripts/bench-peers passes the benchmarks' Phi-3-sized 32k tokenizer); Phi-3's chat template and special
tokens are written next to it. Runs in the exporter environment (.venv-export); never used by the runtime.

    .venv-export/bin/python scripts/make_random_phi3.py OUT --tokenizer tokenizer.json [--hidden 1536 ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers
from demo_models_common import assert_close, io_contract, ort_session, write_json
from make_demo_models import PHI3_CHAT_TEMPLATE, export_llm, prompt_feeds, torch_reference
from transformers import Phi3Config, Phi3ForCausalLM

PHI3_SPECIALS = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")


def build_config(args: argparse.Namespace, tokenizer: dict) -> Phi3Config:
    vocab = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    vocab.update(tokenizer["model"].get("vocab", {}))
    missing = [t for t in ("<s>", "<|endoftext|>", "<|end|>") if t not in vocab]
    if missing:
        sys.exit(f"make_random_phi3: --tokenizer {args.tokenizer} lacks the Phi-3 tokens {missing}")
    if max(vocab.values()) >= args.vocab:
        sys.exit(f"make_random_phi3: --vocab {args.vocab} is smaller than the tokenizer ({max(vocab.values()) + 1})")
    if args.hidden % args.heads:
        sys.exit(f"make_random_phi3: --hidden {args.hidden} is not a multiple of --heads {args.heads}")
    return Phi3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        initializer_range=0.02,
        attn_implementation="eager",
    )


def write_tokenizer_files(folder: Path, tokenizer: dict, cfg: Phi3Config) -> None:
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    ids = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    added = {
        str(t["id"]): {k: t.get(k, False) for k in ("content", "lstrip", "normalized", "rstrip", "single_word")}
        | {"special": True}
        for t in tokenizer.get("added_tokens", [])
    }
    specials = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"}
    write_json(
        folder / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_eos_token": False,
            "added_tokens_decoder": added,
            **specials,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "padding_side": "left",
            "tokenizer_class": "LlamaTokenizerFast",
            "chat_template": PHI3_CHAT_TEMPLATE,
        },
    )
    write_json(folder / "special_tokens_map.json", {k: {"content": v} for k, v in specials.items()})
    stop = [ids[t] for t in ("<|endoftext|>", "<|assistant|>", "<|end|>") if t in ids]
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": stop,
            "pad_token_id": cfg.pad_token_id,
            "transformers_version": transformers.__version__,
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (replaced)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a Phi-3-style tokenizer.json")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32064)
    parser.add_argument("--seed", type=int, default=1438)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    tokenizer = json.loads(args.tokenizer.read_text())
    cfg = build_config(args, tokenizer)
    torch.manual_seed(args.seed)
    model = Phi3ForCausalLM(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"random Phi-3: {n_params / 1e6:.1f} M parameters", flush=True)
    prompt = [int(t) for t in np.random.default_rng(args.seed).integers(300, 30000, size=12)]

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "model.onnx"
        export_llm(model, full)
        logits, _, _ = torch_reference(model, prompt, 1)
        graph = onnx.load(str(full))
        onnx.save(
            graph,
            str(args.out / "model.onnx"),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
            size_threshold=4096,
        )
        del graph
    run = ort_session(args.out / "model.onnx")
    assert_close("random Phi-3 prompt logits", run(prompt_feeds(prompt, cfg))["logits"][0], logits)
    del run

    cfg.architectures = ["Phi3ForCausalLM"]
    cfg.save_pretrained(args.out)
    write_tokenizer_files(args.out, tokenizer, cfg)
    write_json(args.out / "io_contract.json", io_contract(args.out))
    write_json(
        args.out / "generator.json",
        {
            "generator": "scripts/make_random_phi3.py",
            "parameters": n_params,
            "seed": args.seed,
            "config": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "intermediate", "vocab")},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        },
    )
    print(f"wrote {args.out} ({n_params / 1e6:.1f} M parameters, ONNX logits match torch)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
