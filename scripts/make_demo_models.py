"""Generate the demo/test models under edge_agent/demo_models/.

Tiny random-weight models with the exact Hugging Face architectures (Phi-3, Gemma, Gemma-2,
Whisper, wav2vec2-CTC), built from configs and fixed seeds, exported with torch.onnx.export
(opset 18, standard ops only) in the layout `optimum-cli export onnx` produces, and checked
against PyTorch references on ONNX Runtime before anything is written.

Runs in its own environment (see scripts/make-demo-models); the runtime never imports this file.
Usage: python scripts/make_demo_models.py [--out DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import transformers
from demo_models_common import (
    EXTERNAL_MIN_ELEMENTS,
    OUT,
    SEEDS,
    assert_close,
    onnx_export,
    ort_session,
    save_config,
    save_npz,
    train_bpe,
    wide_corpus,
    write_common,
    write_json,
    write_tokenizer,
)
from tokenizers import Tokenizer, processors
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)

LLM_VOCAB = 1024  # model vocab; the tokenizers have 1000 entries, padded like Phi-3's 32064
TOKENIZER_SIZE = 1000
SMALL_VOCAB = 8000  # demo-phi3-small: its tokenizer covers every one of its logits
N_NEW = 24  # greedy steps in the references: 8-token prompt + 24 > Gemma-2's window of 16
PROMPT = "The weather today is bright, and the river"
PROMPT2 = "Hello there, how are you?"
DATA_ALIGN = 4096  # page-aligned tensor offsets in model.onnx.data (memory-mappable)

# The families' real chat templates (Phi-3-mini-4k-instruct and gemma-*-it tokenizer_config.json).
PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


# ----------------------------------------------------------------------------- small helpers


def load_materialize_module():
    """Load the runtime's numpy-only materializer by path, so edge_agent/__init__ (runtime deps) is not imported."""
    path = OUT / "materialize.py"
    spec = importlib.util.spec_from_file_location("demo_materialize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- tokenizers


def llm_tokenizer(family: str, size: int = TOKENIZER_SIZE) -> tuple[Tokenizer, dict[str, Any]]:
    """Returns the tokenizer and the family's special-token metadata. A size beyond what CORPUS can
    teach (demo-phi3-small's 8000: a tokenizer that covers every logit) trains on ``wide_corpus``."""
    corpus = wide_corpus() if size > TOKENIZER_SIZE else None
    if family == "phi3":
        # Phi-3: <unk>=0 <s>=1 </s>=2, chat tokens appended after the vocabulary (32000.. in the real one).
        tok = train_bpe(
            size,
            ["<unk>", "<s>", "</s>"],
            ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
            corpus,
        )
        meta = {
            "bos": "<s>",
            "eos": "<|endoftext|>",
            "pad": "<|endoftext|>",
            "unk": "<unk>",
            "add_bos": False,
            "stop": ["<|endoftext|>", "<|assistant|>", "<|end|>"],
            "template": PHI3_CHAT_TEMPLATE,
        }
    else:
        # Gemma: <pad>=0 <eos>=1 <bos>=2 <unk>=3 as in the real vocabulary; the tokenizer prepends <bos>.
        tok = train_bpe(size, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], [], corpus)
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
        )
        meta = {
            "bos": "<bos>",
            "eos": "<eos>",
            "pad": "<pad>",
            "unk": "<unk>",
            "add_bos": True,
            "stop": ["<eos>", "<end_of_turn>"],
            "template": GEMMA_CHAT_TEMPLATE,
        }
    assert tok.decode(tok.encode(PROMPT).ids) == PROMPT  # the added <bos> is skipped when decoding
    meta["ids"] = {k: tok.token_to_id(meta[k]) for k in ("bos", "eos", "pad", "unk")}
    meta["stop_ids"] = [tok.token_to_id(t) for t in meta["stop"]]
    return tok, meta


def write_llm_tokenizer(folder: Path, tok: Tokenizer, meta: dict[str, Any]) -> None:
    """The tokenizer files and generation_config.json (its special ids) of an LLM folder."""
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": meta["ids"]["bos"],
            "eos_token_id": meta["stop_ids"],
            "pad_token_id": meta["ids"]["pad"],
            "transformers_version": transformers.__version__,
        },
    )
    write_tokenizer(folder, tok, meta)


# ----------------------------------------------------------------------------- causal LMs


def llm_config(name: str, vocab: int, meta: dict[str, Any]) -> transformers.PretrainedConfig:
    ids = meta["ids"]
    # initializer_range 0.2 (HF default 0.02) gives the tiny Phi-3/Gemma peaked logits and varied greedy
    # tokens instead of repeating the last prompt token; Gemma-2 (sandwich norms, soft-caps) varies at 0.02.
    common = dict(
        vocab_size=vocab,
        num_hidden_layers=2,
        num_attention_heads=4,
        bos_token_id=ids["bos"],
        pad_token_id=ids["pad"],
        initializer_range=0.2,
        attn_implementation="eager",
    )
    if name == "demo-phi3":
        # Real Phi-3-mini-4k sets sliding_window=2047; left unset here so the graph carries a plain causal mask.
        return Phi3Config(
            hidden_size=64,
            intermediate_size=192,
            num_key_value_heads=4,
            eos_token_id=ids["eos"],
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            **common,
        )
    if name == "demo-phi3-small":  # the benchmark size: 28.6 M parameters
        common.update(num_hidden_layers=6, num_attention_heads=8, initializer_range=0.02)
        return Phi3Config(
            hidden_size=512,
            intermediate_size=1536,
            num_key_value_heads=8,
            eos_token_id=ids["eos"],
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            **common,
        )
    if name == "demo-gemma":  # MQA like gemma-2b
        return GemmaConfig(
            hidden_size=64, intermediate_size=256, num_key_value_heads=1, head_dim=16, eos_token_id=ids["eos"], **common
        )
    # Gemma-2: GQA, both soft-caps, sliding window on even layers / global attention on odd ones.
    common.update(initializer_range=0.02)
    return Gemma2Config(
        hidden_size=64,
        intermediate_size=256,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        eos_token_id=meta["stop_ids"],
        **common,
    )


class CausalLMWithPast(torch.nn.Module):
    """Flat named I/O around a HF causal LM: (input_ids, attention_mask, position_ids, k0, v0, k1, v1, ...)
    -> (logits, present k0, v0, ...). A plain DynamicCache (no sliding layers) keeps every layer's present at
    past+seq, as optimum exports do; Gemma-2's sliding window is then applied by the attention mask."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        return (out.logits, *[t for layer in out.cache.layers for t in (layer.keys, layer.values)])


def llm_io_names(n_layers: int) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
    kv = [f"{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{n}" for n in kv]
    outputs = ["logits"] + [f"present.{n}" for n in kv]
    step = {0: "batch_size", 1: "sequence_length"}
    axes = {
        "input_ids": step,
        "position_ids": step,
        "logits": step,
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
    }
    axes.update({f"past_key_values.{n}": {0: "batch_size", 2: "past_sequence_length"} for n in kv})
    axes.update({f"present.{n}": {0: "batch_size", 2: "total_sequence_length"} for n in kv})
    return inputs, outputs, axes


def export_llm(model: torch.nn.Module, path: Path) -> None:
    cfg = model.config
    inputs, outputs, axes = llm_io_names(cfg.num_hidden_layers)
    b, s, p = 2, 3, 5  # trace with a non-empty past and a left-padded row so no shortcut gets baked in
    mask = torch.ones(b, p + s, dtype=torch.int64)
    mask[1, :2] = 0
    past = [torch.zeros(b, cfg.num_key_value_heads, p, head_dim(cfg)) for _ in outputs[1:]]
    args = (torch.ones(b, s, dtype=torch.int64), mask, (mask.cumsum(-1) - 1).clamp(min=0)[:, p:], *past)
    onnx_export(CausalLMWithPast(model).eval(), args, path, inputs, outputs, axes)


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def past_feeds(cfg: Any, batch: int, length: int = 0, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """past_key_values.* inputs: empty (the first step) or random of the given length."""
    shape = (batch, cfg.num_key_value_heads, length, head_dim(cfg))
    return {
        f"past_key_values.{i}.{k}": rng.standard_normal(shape, np.float32) if rng else np.zeros(shape, np.float32)
        for i in range(cfg.num_hidden_layers)
        for k in ("key", "value")
    }


def prompt_feeds(prompt: list[int], cfg: Any) -> dict[str, np.ndarray]:
    n = len(prompt)
    return {
        "input_ids": np.array([prompt], np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
        **past_feeds(cfg, 1),
    }


def greedy(run: Callable, prompts: list[list[int]], n_new: int, cfg: Any, pad_id: int) -> np.ndarray:
    """Greedy decode with a KV cache through the flat contract; prompts of different lengths are left-padded
    and position_ids = cumsum(mask) - 1 clipped at 0, the way the runtime batches them."""
    batch, width = len(prompts), max(map(len, prompts))
    ids = np.full((batch, width), pad_id, np.int64)
    mask = np.zeros((batch, width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    feeds, new = past_feeds(cfg, batch), []
    for _ in range(n_new):
        positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)[:, -ids.shape[1] :]
        out = run({"input_ids": ids, "attention_mask": mask, "position_ids": positions, **feeds})
        ids = out["logits"][:, -1].argmax(-1).astype(np.int64)[:, None]
        new.append(ids[:, 0])
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
        feeds = {k.replace("present", "past_key_values"): v for k, v in out.items() if k.startswith("present")}
    return np.stack(new, 1)


def torch_runner(module: torch.nn.Module, names: list[str]) -> Callable:
    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names]
        with torch.no_grad():
            return {
                k: v.numpy()
                for k, v in zip(
                    ["logits"] + [n.replace("past_key_values", "present") for n in names[3:]], module(*args)
                )
            }

    return run


def torch_reference(model: torch.nn.Module, prompt: list[int], n_new: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The model's own HF path (its default cache, sliding layers included): prompt logits in one pass, then
    n_new raw argmax tokens (EOS is not special here). Also returns the smallest top-1/top-2 logit margin."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
        out = model(input_ids=ids, use_cache=True)
        tokens, margin = [], float("inf")
        for _ in range(n_new):
            last = out.logits[0, -1]
            top2 = torch.topk(last, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            tokens.append(int(last.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return logits.numpy(), np.array(tokens, np.int64), margin


def build_llm(name: str, out_dir: Path) -> dict[str, Any]:
    family = "phi3" if name.startswith("demo-phi3") else "gemma"
    tok, meta = llm_tokenizer(family)
    torch.manual_seed(SEEDS[name])
    model = {"demo-phi3": Phi3ForCausalLM, "demo-gemma": GemmaForCausalLM, "demo-gemma2": Gemma2ForCausalLM}[name](
        llm_config(name, LLM_VOCAB, meta)
    ).eval()
    folder = out_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    export_llm(model, folder / "model.onnx")

    cfg, pad = model.config, meta["ids"]["pad"]
    prompts = [tok.encode(PROMPT).ids, tok.encode(PROMPT2).ids]
    assert 6 <= len(prompts[0]) <= 12 and len(prompts[1]) < len(prompts[0]), [len(p) for p in prompts]
    refs = [torch_reference(model, p, N_NEW) for p in prompts]
    # Runtimes (ORT, OpenVINO f32) differ from torch by ~1e-6: keep every greedy step clear of a near-tie.
    assert min(r[2] for r in refs) > 1e-3, f"{name}: greedy argmax too close to a tie; pick another seed"
    if name == "demo-gemma2":  # the reference must depend on the sliding window, or it would not test it
        full_attention = copy.deepcopy(model)
        full_attention.config.sliding_window = 4096
        assert (torch_reference(full_attention, prompts[0], N_NEW)[1] != refs[0][1]).any(), "window has no effect"

    # The ONNX graph must reproduce the torch references: prompt logits, cached greedy decode, left-padded batch.
    run = ort_session(folder / "model.onnx")
    inputs, _, _ = llm_io_names(cfg.num_hidden_layers)
    adapter = torch_runner(CausalLMWithPast(model).eval(), inputs)
    for (logits, tokens, _), prompt in zip(refs, prompts):
        assert_close(f"{name} prompt logits", run(prompt_feeds(prompt, cfg))["logits"][0], logits)
        for runner in (run, adapter):
            assert (greedy(runner, [prompt], N_NEW, cfg, pad)[0] == tokens).all(), f"{name}: greedy differs"
    for runner, what in ((run, "onnx"), (adapter, "torch")):
        batched = greedy(runner, prompts, N_NEW, cfg, pad)
        assert (batched == np.stack([refs[0][1], refs[1][1]])).all(), f"{name} ({what}): batched != unbatched"
    # A chunk of 3 tokens on top of a 20-token past (beyond the window), batch 2 with a left-padded row.
    rng = np.random.default_rng(0)
    mask = np.ones((2, 23), np.int64)
    mask[1, :4] = 0
    feeds = {
        "input_ids": rng.integers(0, TOKENIZER_SIZE, (2, 3)),
        "attention_mask": mask,
        "position_ids": np.clip(np.cumsum(mask, 1) - 1, 0, None)[:, -3:],
        **past_feeds(cfg, 2, 20, rng),
    }
    want = adapter(feeds)
    for key, value in run(feeds).items():
        assert_close(f"{name} {key} (past 20 + 3)", value, want[key])

    save_config(cfg, type(model).__name__, folder)
    write_llm_tokenizer(folder, tok, meta)
    save_npz(
        folder / "reference.npz",
        {
            "prompt_ids": np.array(prompts[0], np.int64),
            "prompt_logits": refs[0][0],
            "greedy_ids": refs[0][1],
            "prompt2_ids": np.array(prompts[1], np.int64),
            "greedy2_ids": refs[1][1],
        },
    )
    write_common(folder, name, {"parameters": sum(p.numel() for p in model.parameters())})
    return {"min_margin": min(r[2] for r in refs), "eos_in_greedy": bool(np.isin(refs[0][1], meta["stop_ids"]).any())}


# ----------------------------------------------------------------------------- demo-phi3-small (weights not committed)


def build_phi3_small(out_dir: Path) -> dict[str, Any]:
    """Export the graph, move every large initializer to model.onnx.data and record, instead of the bytes,
    a numpy recipe (weights.json) that regenerates them; the runtime materializes the data on first use."""
    name = "demo-phi3-small"
    tok, meta = llm_tokenizer("phi3", SMALL_VOCAB)
    prompt = tok.encode(PROMPT).ids
    torch.manual_seed(SEEDS[name])
    model = Phi3ForCausalLM(llm_config(name, SMALL_VOCAB, meta)).eval()
    cfg, n_params = model.config, sum(p.numel() for p in model.parameters())
    folder = out_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "model.onnx"
        export_llm(model, full)
        # Check the exported graph against torch while it still holds torch's weights.
        logits, tokens, _ = torch_reference(model, prompt, 4)
        run = ort_session(full)
        assert_close(f"{name} prompt logits", run(prompt_feeds(prompt, cfg))["logits"][0], logits)
        assert (greedy(run, [prompt], 4, cfg, meta["ids"]["pad"])[0] == tokens).all(), f"{name}: greedy differs"
        del model, run
        graph = onnx.load(str(full))

    tensors, offset = [], 0
    for init in graph.graph.initializer:
        if np.prod(init.dims) < EXTERNAL_MIN_ELEMENTS:
            continue  # norm weights, rotary inv_freq and small constants stay embedded in the graph
        assert init.data_type == onnx.TensorProto.FLOAT, init.name
        offset = -(-offset // DATA_ALIGN) * DATA_ALIGN
        length = 4 * int(np.prod(init.dims))
        tensors.append(
            {
                "name": init.name,
                "offset": offset,
                "length": length,
                "dtype": "float32",
                "shape": list(init.dims),
                "init": "normal",
                "std": cfg.initializer_range,
                "seed": zlib.crc32(f"{name}/{init.name}".encode()),
            }
        )
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "model.onnx.data"), ("offset", offset), ("length", length)):
            init.external_data.add(key=key, value=str(value))
        offset += length
    onnx.save(graph, str(folder / "model.onnx"))
    del graph

    save_config(cfg, "Phi3ForCausalLM", folder)
    write_llm_tokenizer(folder, tok, meta)
    # The recipe's sha256 comes from the runtime's own materializer, which is then checked end to end.
    mat = load_materialize_module()
    recipe = {
        "format": 1,
        "file": "model.onnx.data",
        "data_bytes": offset,
        "data_sha256": None,
        "align": DATA_ALIGN,
        "tensors": tensors,
    }
    recipe["data_sha256"] = mat.recipe_sha256(recipe)
    write_json(folder / "weights.json", recipe)
    write_common(folder, name, {"parameters": n_params})
    with tempfile.TemporaryDirectory() as tmp:
        dst = mat.materialize(folder, Path(tmp) / name)
        logits = ort_session(dst / "model.onnx")(prompt_feeds(prompt, cfg))["logits"]
        assert np.isfinite(logits).all() and logits.std() > 0, "materialized demo-phi3-small gives bad logits"
    return {"parameters": n_params, "data_bytes": offset, "external_tensors": len(tensors)}


def retokenize_phi3_small(out_dir: Path) -> dict[str, Any]:
    """Only demo-phi3-small's tokenizer and the special ids in its configs (what build_phi3_small writes
    for them), leaving the graph and weights.json as they are: the weights never depend on the
    tokenizer, so this equals a full rebuild without re-exporting the model."""
    folder = out_dir / "demo-phi3-small"
    tok, meta = llm_tokenizer("phi3", SMALL_VOCAB)
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=meta["ids"]["bos"], eos_token_id=meta["ids"]["eos"], pad_token_id=meta["ids"]["pad"])
    assert config["vocab_size"] == tok.get_vocab_size() == SMALL_VOCAB
    write_json(folder / "config.json", config)
    write_llm_tokenizer(folder, tok, meta)
    return {"vocab": tok.get_vocab_size(), "eos": meta["ids"]["eos"]}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="*", default=list(SEEDS), choices=list(SEEDS))
    parser.add_argument(
        "--tokenizer-only", action="store_true", help="demo-phi3-small: rewrite its tokenizer and special ids only"
    )
    args = parser.parse_args(argv)
    if args.tokenizer_only:
        print(f"demo-phi3-small: tokenizer {json.dumps(retokenize_phi3_small(args.out))}", flush=True)
        return 0
    # One thread and deterministic kernels: the references are then byte-identical from run to run.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_demo_models_speech as speech  # sibling file: Whisper and wav2vec2-CTC

    builders = {
        "demo-phi3": build_llm,
        "demo-gemma": build_llm,
        "demo-gemma2": build_llm,
        "demo-phi3-small": lambda _n, out: build_phi3_small(out),
        "demo-whisper": lambda _n, out: speech.build_whisper(out),
        "demo-ctc": lambda _n, out: speech.build_ctc(out),
    }
    for name in args.only:
        print(f"{name}: building", flush=True)
        info = builders[name](name, args.out)
        size = sum(f.stat().st_size for f in (args.out / name).iterdir())
        print(f"{name}: ok, {size / 1e6:.2f} MB committed  {json.dumps(info)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
