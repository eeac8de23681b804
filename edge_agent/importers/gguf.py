"""``edge-agent models import FILE.gguf``: a GGUF decoder becomes a model folder in the export contract.

The folder holds ``model.onnx`` + ``model.onnx.data`` (float32 weights, dequantized from the file's
blocks), ``config.json`` and ``generation_config.json`` in transformers' words, ``tokenizer.json`` and
``tokenizer_config.json`` rebuilt from the file's vocabulary, and ``import.json`` (the source file, its
sha256, the block types it held). It is an ordinary model folder: every backend, recipe, engine build
and accuracy gate applies to it. Nothing is written at the destination unless the whole import succeeds.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelError
from .gguf_arch import DecoderSpec, check_tensors, hf_config, read_spec
from .gguf_file import GgufFile
from .result import ImportResult, ProgressFn, imported_dir
from .staging import check_destination, check_free_space, sha256_file, staged_folder

IMPORT_RECORD = "import.json"
IMPORTER_VERSION = 3  # bumped when the folder this import writes changes (graph, tokenizer, config)


def default_name(f: GgufFile) -> str:
    """A folder name from the file's ``general.name`` (``Gemma 3 270m`` -> ``gemma-3-270m``), else its stem."""
    raw = f.get("general.name", "")
    raw = raw if isinstance(raw, str) and raw else f.path.stem
    return re.sub(r"[^a-z0-9.]+", "-", raw.lower()).strip("-.") or "imported-model"


def fp32_bytes(spec: DecoderSpec) -> int:
    """The float32 weights' size in bytes (what the folder's data file will hold, before alignment)."""
    attn = spec.hidden * spec.head_dim * (2 * spec.heads + 2 * spec.kv_heads)
    mlp = 3 * spec.hidden * spec.ffn
    norms = spec.hidden * (4 if spec.sandwich_norms else 2) + (2 * spec.head_dim if spec.qk_norm else 0)
    head = 0 if spec.tied_head else spec.vocab * spec.hidden
    return 4 * (spec.vocab * spec.hidden + head + spec.layers * (attn + mlp + norms) + spec.hidden)


def import_gguf(
    src: Path, out: Path | None, cache_dir: Path, name: str | None = None, progress: ProgressFn | None = None
) -> ImportResult:
    """Import the GGUF ``src`` into ``out`` (default ``<cache_dir>/imported/<name>``)."""
    started = time.monotonic()
    f = GgufFile(src)
    spec = read_spec(f)
    check_tensors(f, spec)
    n_tokens = _vocab_size(f, spec)
    name = name or default_name(f)
    dest = check_destination(Path(out) if out is not None else imported_dir(cache_dir) / name)
    check_free_space(dest, fp32_bytes(spec) + (64 << 20))
    total = spec.layers + 3  # tokenizer, layers, head, checksum
    done = 0

    def step(n: int = 1) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    with staged_folder(dest) as folder:
        tok_config = _write_tokenizer_and_configs(f, spec, folder)
        step()
        _write_graph(f, spec, folder, step)
        step()
        source_sha = sha256_file(f.path)
        step()
        record = _import_record(f, spec, name, folder, source_sha, n_tokens, tok_config)
        (folder / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    details = {
        "import_s": round(time.monotonic() - started, 1),
        "layers": spec.layers,
        "hidden": spec.hidden,
        "vocab": spec.vocab,
        "parameters": fp32_bytes(spec) // 4,
        "source_sha256": source_sha,
        "block_types": dict(Counter(t.block_type for t in f.tensor_infos())),
        "seconds": round(time.monotonic() - started, 1),
    }
    return ImportResult(name, dest, "gguf", spec.arch, details)


def _vocab_size(f: GgufFile, spec: DecoderSpec) -> int:
    """How many tokens the file's vocabulary holds: as many as the embedding table has rows, else refused."""
    if not f.has("tokenizer.ggml.tokens"):
        raise ModelError(f"{f.path}: no tokenizer in the file (metadata tokenizer.ggml.tokens is missing)")
    n_tokens = len(f.strings("tokenizer.ggml.tokens"))
    if n_tokens != spec.vocab:
        raise ModelError(
            f"{f.path}: the vocabulary has {n_tokens:,} tokens but the embedding table has {spec.vocab:,} rows"
        )
    return n_tokens


def _write_tokenizer_and_configs(f: GgufFile, spec: DecoderSpec, folder: Path) -> dict:
    """``tokenizer.json``, ``tokenizer_config.json``, ``config.json`` and ``generation_config.json`` into
    ``folder``; returns the tokenizer config."""
    from tokenizers import Tokenizer

    from .gguf_tokenizer import write_tokenizer

    tok_config = write_tokenizer(f, spec.arch, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = f.get("tokenizer.ggml.bos_token_id", None)
    eos = f.get("tokenizer.ggml.eos_token_id", None)
    pad = f.get("tokenizer.ggml.padding_token_id", None)
    eos_ids = [int(eos)] if eos is not None else []
    end_of_turn = tok.token_to_id("<end_of_turn>") if spec.arch == "gemma3" else None
    if end_of_turn is not None and end_of_turn not in eos_ids:
        eos_ids.append(end_of_turn)  # chat turns end there (what Gemma's generation config lists)
    config = hf_config(spec, int(bos) if bos is not None else None, eos_ids, int(pad) if pad is not None else None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids, "pad_token_id": pad}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return tok_config


def _write_graph(f: GgufFile, spec: DecoderSpec, folder: Path, step: Callable[[], None]) -> None:
    """``model.onnx`` and its float32 data file; ``step`` is called after each layer."""
    import onnx

    from ..graphs.decoder import build_decoder

    model = build_decoder(spec, f.tensor, folder, progress=lambda layer: step())
    onnx.save_model(model, str(folder / "model.onnx"))


def _import_record(
    f: GgufFile, spec: DecoderSpec, name: str, folder: Path, source_sha: str, n_tokens: int, tok_config: dict
) -> dict:
    """``import.json`` (the same bytes for the same source and importer: it is part of the folder's hash, which
    keys its engines): the source file, what was written from it."""
    from ..graphs.decoder import DATA_FILE

    return {
        "format": 1,
        "importer": IMPORTER_VERSION,
        "source": {
            "format": "gguf",
            "file": f.path.name,
            "bytes": f.size_bytes,
            "sha256": source_sha,
            "gguf_version": f.version,
            "block_types": dict(Counter(t.block_type for t in f.tensor_infos())),
        },
        "architecture": spec.arch,
        "name": name,
        "weights": {"file": DATA_FILE, "dtype": "float32", "bytes": (folder / DATA_FILE).stat().st_size},
        "tokenizer": {"tokens": n_tokens, "add_bos_token": tok_config["add_bos_token"]},
    }
