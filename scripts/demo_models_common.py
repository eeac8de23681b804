"""What both demo-model generators share (make_demo_models.py, make_demo_models_speech.py): the
output folder, seeds and opset, file writers, the ONNX export and its checks, the BPE tokenizer
trainer. Both import it; neither imports the other's module at load time.

Runs in the generator's own environment (scripts/make-demo-models), like the two scripts.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "edge_agent" / "demo_models"
OPSET = 18
SEEDS = {
    "demo-phi3": 1301,
    "demo-gemma": 1302,
    "demo-gemma2": 1312,
    "demo-phi3-small": 1304,
    "demo-whisper": 1306,
    "demo-ctc": 1307,
}
EXTERNAL_MIN_ELEMENTS = 4096  # demo-phi3-small: bigger initializers go to model.onnx.data

# Deterministic training text for the byte-level BPE tokenizers (plain English, varied topics).
CORPUS = """\
The weather today is bright and warm, with a light wind from the west and a few clouds over the hills.
Tomorrow the forecast says rain in the morning, then sun in the afternoon, and a cold night after that.
Hello there! How are you doing today? I am fine, thank you, and I hope your day is going well.
Please tell me a short story about a small robot who lives in a quiet village near the river.
The robot wakes up early every morning, checks its battery, and walks to the market to help the people.
It carries bread, fruit, and fresh water for the old baker, who always gives it a warm smile in return.
One day the river rose after a long storm, and the bridge to the village was closed for three days.
The robot measured the water level every hour and sent a short message to the people on the other side.
Edge devices run models close to the data: a camera, a microphone, or a sensor on a factory floor.
A small language model can answer questions, summarize notes, and translate simple sentences offline.
Latency matters: people stop waiting when the first word takes longer than a few hundred milliseconds.
The agent measures the time to the first token, the gap between tokens, and the total time of each request.
When the device is busy, it can switch to a smaller model, shorten the answer, or ask the client to retry.
Speech recognition turns audio into text; the model listens to sixteen thousand samples every second.
Say the word yes or no, then wait for the light to turn green before you speak the next command.
Turn on the kitchen lights, set a timer for ten minutes, and play some quiet music in the living room.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
How many days are there in a week? There are seven days in a week and twelve months in a year.
Cooking rice is simple: rinse it, add water, bring it to a boil, then cover the pot and wait twenty minutes.
A good cup of tea needs fresh water, a clean pot, and a little patience while the leaves open slowly.
The train leaves the station at nine in the morning and arrives in the city just before noon.
Children play in the park after school, running between the trees and laughing in the afternoon sun.
Numbers and dates appear often: 1, 2, 3, 10, 42, 100, 2024, 3.14, and 12:30 are all common in text.
The quick brown fox jumps over the lazy dog, and the lazy dog does not seem to mind at all.
Write clear code, test it often, and keep the important numbers in one place where everyone can find them.
If the network is down, the messages wait on the disk and are sent again when the connection returns.
Good morning! Good evening! Good night! See you later, and thank you for your help with the project.
The library opens at eight, closes at six, and keeps a quiet room for reading on the second floor.
She asked a simple question, and he gave a long answer that did not really answer the question at all.
We walked along the beach, collected shells, and watched the boats come back before the sun went down.
Mountains, forests, and lakes cover the northern region, where winters are long and summers are short.
Engineers calibrate sensors with known samples, compare the readings, and record every correction.
My favourite colours are blue, green, and yellow; my brother prefers purple, orange, and deep red.
Could you explain why the sky looks blue during the day but turns orange and pink at sunset?
"""


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez stamps the current time into the zip entries; fixed timestamps keep the file byte-identical."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(value), allow_pickle=False)


def onnx_export(
    module: torch.nn.Module,
    args: tuple,
    path: Path,
    inputs: list[str],
    outputs: list[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> None:
    """TorchScript exporter: it traces DynamicCache-based code with dynamic past lengths without fuss,
    and produces plain opset-18 graphs (the dynamo exporter needs torch.export-friendly cache code)."""
    # Eval mode on the wrapper too: the exporter restores the wrapper's train/eval mode onto every submodule
    # afterwards, and a fresh wrapper is in train mode (dropout would then spoil the torch references).
    module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic_axes,
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    model = onnx.load(str(path))
    if retie_transposed_weights(model):
        onnx.save(model, str(path))
    foreign = {n.domain for n in model.graph.node} - {"", "ai.onnx"}
    assert not foreign, f"{path.name}: non-standard op domains {foreign}"
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [OPSET]


def retie_transposed_weights(model: onnx.ModelProto) -> int:
    """Constant folding stores a tied matrix twice (embedding for Gather, its transpose for the LM head's MatMul).
    Put the tie back as one Transpose node: same numbers, half the bytes on disk; runtimes fold it at load."""
    graph = model.graph
    big = [i for i in graph.initializer if len(i.dims) == 2 and np.prod(i.dims) >= EXTERNAL_MIN_ELEMENTS]
    transposed = {
        hashlib.sha256(np.ascontiguousarray(onnx.numpy_helper.to_array(i).T).tobytes()).digest(): i.name for i in big
    }
    nodes, dropped, sources = [], [], set()
    # Each pair matches both ways: replace the folded copy ("onnx::..." name) and keep the named parameter.
    for init in sorted(big, key=lambda i: not i.name.startswith("onnx::")):
        source = transposed.get(hashlib.sha256(onnx.numpy_helper.to_array(init).tobytes()).digest())
        if (
            source is not None
            and init.dims[0] != init.dims[1]
            and init.name not in sources
            and source not in {d.name for d in dropped}
        ):
            sources.add(source)
            nodes.append(
                onnx.helper.make_node("Transpose", [source], [init.name], perm=[1, 0], name=f"/retie/{init.name}")
            )
            dropped.append(init)
    for init in dropped:
        graph.initializer.remove(init)
    for node in reversed(nodes):
        graph.node.insert(0, node)
    return len(nodes)


def io_contract(folder: Path) -> dict[str, Any]:
    """Inputs/outputs of every ONNX file in the folder, as the runtime must feed and read them."""

    def describe(value: onnx.ValueInfoProto) -> dict[str, Any]:
        tensor = value.type.tensor_type
        dims = []
        for d in tensor.shape.dim:
            assert d.HasField("dim_param") or d.HasField("dim_value"), f"{value.name}: unnamed dynamic dim"
            dims.append(d.dim_param if d.HasField("dim_param") else d.dim_value)
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
        return {"name": value.name, "dtype": dtype, "shape": dims}

    contract = {}
    for path in sorted(folder.glob("*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        init = {i.name for i in graph.initializer}
        contract[path.name] = {
            "inputs": [describe(v) for v in graph.input if v.name not in init],
            "outputs": [describe(v) for v in graph.output],
        }
    return contract


def ort_session(path: Path) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda feeds: dict(zip(names, sess.run(None, feeds)))


def assert_close(name: str, got: np.ndarray, want: np.ndarray, tol: float = 1e-4) -> None:
    """Absolute tolerance scaled by the reference's magnitude ("relative-ish")."""
    err = float(np.abs(got.astype(np.float64) - want).max())
    limit = tol * max(1.0, float(np.abs(want).max()))
    assert got.shape == want.shape and err <= limit, f"{name}: max abs diff {err:.3g} > {limit:.3g} {got.shape}"


def write_common(folder: Path, name: str, extra: dict[str, Any] | None = None) -> None:
    write_json(folder / "io_contract.json", io_contract(folder))
    write_json(
        folder / "generator.json",
        {
            "generator": "scripts/make_demo_models.py",
            "model": name,
            "seed": SEEDS[name],
            **(extra or {}),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "onnx": onnx.__version__,
                "onnxruntime": ort.__version__,
                "tokenizers": tokenizers.__version__,
                "numpy": np.__version__,
            },
            "date": datetime.date.today().isoformat(),
        },
    )


def save_config(config: transformers.PretrainedConfig, architecture: str, folder: Path) -> None:
    config.architectures = [architecture]
    config.save_pretrained(folder)


def wide_corpus(words: int = 60_000, seed: int = 8000) -> list[str]:
    """CORPUS plus deterministic pseudo-English (syllable words, numbers, punctuation): enough distinct
    text for a byte-level BPE of several thousand tokens, the same on every machine."""
    import random

    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "ch",
        "sh",
    ]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck"]
    lexicon = sorted(
        {
            "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
            for _ in range(12_000)
        }
    )
    lines, line = [], []
    for i in range(words):
        word = rng.choice(lexicon)
        line.append(word.capitalize() if not line else word)
        if rng.random() < 0.04:
            line.append(str(rng.randint(0, 2000)))
        if rng.random() < 0.08 or i == words - 1:
            lines.append(" ".join(line) + rng.choice([".", "!", "?", ","]))
            line = []
    return CORPUS.splitlines() + lines


def train_bpe(vocab_size: int, first: list[str], last: list[str], corpus: list[str] | None = None) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): encode -> decode round-trips any text. `first` special tokens get
    ids 0.. (as in the real vocabularies), `last` ones are appended after the trained vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(last),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in first],
    )
    tok.train_from_iterator(corpus or CORPUS.splitlines(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in last])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    for text in [*CORPUS.splitlines()[:5], "Ünïcödé ✓ 42\n\ttabs  and  spaces"]:
        assert tok.decode(tok.encode(text).ids) == text, f"tokenizer round trip failed: {text!r}"
    return tok


def write_tokenizer(folder: Path, tok: Tokenizer, meta: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
        if t.special
    }
    specials = {f"{k}_token": meta[k] for k in ("bos", "eos", "pad", "unk") if k in meta}
    config = {
        "add_bos_token": meta.get("add_bos", False),
        "add_eos_token": False,
        "added_tokens_decoder": added,
        **specials,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        **(extra or {}),
    }
    if "template" in meta:
        config["chat_template"] = meta["template"]
    write_json(folder / "tokenizer_config.json", config)
    write_json(
        folder / "special_tokens_map.json",
        {
            **{
                k: {"content": v, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
                for k, v in specials.items()
            }
        },
    )
