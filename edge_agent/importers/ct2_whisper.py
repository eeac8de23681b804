"""A CTranslate2 Whisper folder (faster-whisper's format) imported as the Whisper folder the agent serves.

Source: ``model.bin`` (spec ``WhisperSpec``; float32, float16, bfloat16, int8 or int16 weights, all
dequantized to float32), ``config.json`` (CTranslate2's: ``suppress_ids``, ``suppress_ids_begin``,
``lang_ids``) and ``tokenizer.json`` (as Systran's faster-whisper folders ship it).

Written (the contract of ``models/asr_whisper.py``): ``encoder_model.onnx``, ``decoder_model.onnx``,
``decoder_with_past_model.onnx`` (``graphs/whisper.py``), ``config.json`` and ``generation_config.json``
in transformers' words (token ids read from the tokenizer: ``<|startoftranscript|>``, the language and
task tokens, ``<|notimestamps|>``; ``suppress_tokens`` and ``begin_suppress_tokens`` from CTranslate2's
config, so greedy decoding suppresses what faster-whisper suppresses), ``preprocessor_config.json``
(Whisper's log-mel settings, the mel count from the first convolution), ``tokenizer.json`` and
``import.json`` (the source's sha256 and dtypes). Neither torch nor ctranslate2 is needed, here or
when the folder is served.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable, ModelError
from .ct2_file import Ct2File
from .result import ImportResult, ProgressFn, imported_dir
from .staging import check_destination, check_free_space, sha256_file, staged_folder

IMPORT_RECORD = "import.json"
GRAPHS = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")


def _layers(f: Ct2File, side: str) -> int:
    pattern = re.compile(rf"^{side}/layer_(\d+)/")
    found = {int(m.group(1)) for name in f.variables if (m := pattern.match(name))}
    if not found or found != set(range(len(found))):
        raise ModelError(f"{f.path}: no {side} layers (or a gap in their numbering): not a Whisper model.bin")
    return len(found)


def read_dims(f: Ct2File):
    """The ``WhisperDims`` of a WhisperSpec ``model.bin``; another spec is refused naming it."""
    from ..graphs.whisper import WhisperDims

    if f.spec != "WhisperSpec":
        raise ModelError(f"{f.path}: a CTranslate2 {f.spec!r}, not a WhisperSpec; models import takes Whisper folders")

    def shape(name: str, rank: int) -> tuple[int, ...]:
        got = f.info(name).shape
        if len(got) != rank or not all(got):
            raise ModelError(f"{f.path}: variable {name!r} has shape {list(got)}; Whisper's has {rank} dimensions")
        return got

    conv1 = shape("encoder/conv1/weight", 3)  # [d, mels, 3]
    embed = shape("decoder/embeddings/weight", 2)  # [vocab, d]
    ffn = shape("encoder/layer_0/ffn/linear_0/weight", 2)[0]
    d = conv1[0]

    def heads(side: str) -> int:
        name = f"{side}/num_heads"
        n = f.scalar(name) if f.has(name) else d // 64
        if not (n == int(n) and 1 <= n <= d and d % int(n) == 0):
            raise ModelError(f"{f.path}: {name} is {n:g}; it must be a whole number of heads dividing {d}")
        return int(n)

    if f.has("decoder/pre_norm") and not f.scalar("decoder/pre_norm"):
        raise ModelError(f"{f.path}: a post-norm decoder is not Whisper's layout")
    return WhisperDims(
        n_mels=conv1[1],
        d_model=d,
        encoder_layers=_layers(f, "encoder"),
        encoder_heads=heads("encoder"),
        decoder_layers=_layers(f, "decoder"),
        decoder_heads=heads("decoder"),
        ffn=ffn,
        vocab=embed[0],
        source_positions=shape("encoder/position_encodings/encodings", 2)[0],
        target_positions=shape("decoder/position_encodings/encodings", 2)[0],
    )


def default_name(src: Path, dims) -> str:
    """``whisper-base`` and the like: from the folder's name when it says which Whisper, else from the width."""
    sizes = {384: "tiny", 512: "base", 768: "small", 1024: "medium", 1280: "large"}
    m = re.search(
        r"whisper[-_.]?(tiny|base|small|medium|large(?:[-_]?v\d)?|turbo|distil[\w-]*)(\.en)?", src.name.lower()
    )
    if m:
        return f"whisper-{m.group(1).replace('_', '-')}{'-en' if m.group(2) else ''}"
    return f"whisper-{sizes.get(dims.d_model, f'd{dims.d_model}')}"


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def _read_config(path: Path) -> dict:
    """CTranslate2's ``config.json``: a JSON object, else a ``ModelError`` naming the file."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelError(f"{path}: not readable JSON ({type(exc).__name__}: {str(exc)[:120]})") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{path}: a JSON {type(config).__name__}, not an object; CTranslate2 writes an object")
    return config


def _ids(config: dict, key: str, path: Path, rows: int, default: list[int] | None = None) -> list[int]:
    """The token ids under ``key`` of CTranslate2's config: a list of integers in 0..rows-1."""
    value = config.get(key)
    if value is None:
        return list(default or [])
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ModelError(f"{path}: {key} is {_show(value)}; it must be a list of token ids (integers)")
    for i in value:
        if not 0 <= i < rows:
            raise ModelError(f"{path}: {key} holds {_show(i)}, outside the model's {rows:,} tokens (0..{rows - 1:,})")
    return value


def _token_ids(tokenizer_path: Path, lang_ids: list[int], rows: int) -> dict:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception for any file it cannot read
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{tokenizer_path}: not a tokenizer.json the tokenizers library reads ({first})") from exc

    def check(text: str, i: int) -> int:
        if not 0 <= i < rows:
            raise ModelError(
                f"{tokenizer_path}: {text} is id {i:,}, outside the model's {rows:,} embedding rows (0..{rows - 1:,})"
            )
        return i

    def need(text: str) -> int:
        i = tok.token_to_id(text)
        if i is None:
            raise ModelError(f"{tokenizer_path}: no token {text!r}; is this a Whisper tokenizer?")
        return check(text, int(i))

    def optional(text: str) -> int | None:
        i = tok.token_to_id(text)
        return None if i is None else check(text, int(i))

    ids: dict = {
        "eot": need("<|endoftext|>"),
        "sot": need("<|startoftranscript|>"),
        "no_timestamps": need("<|notimestamps|>"),
        "transcribe": optional("<|transcribe|>"),
        "translate": optional("<|translate|>"),
        "prev": optional("<|startofprev|>"),
    }
    langs = {}
    for i in lang_ids:
        text = tok.id_to_token(int(i))
        if text is None or not (text.startswith("<|") and text.endswith("|>")):
            raise ModelError(f"{tokenizer_path}: language id {i} is not a language token ({text!r})")
        langs[text] = int(i)
    ids["langs"] = langs
    return ids


def import_ct2_whisper(
    src: Path, out: Path | None, cache_dir: Path, name: str | None = None, progress: ProgressFn | None = None
) -> ImportResult:
    """Import the CTranslate2 Whisper folder ``src`` into ``out`` (default ``<cache_dir>/imported/<name>``)."""
    try:
        import onnx
    except ImportError as exc:
        raise BackendUnavailable("importing a Whisper folder needs the 'onnx' package: pip install onnx") from exc
    from ..graphs.whisper import build_decoder, build_encoder

    started = time.monotonic()
    src = Path(src)
    f, dims, ct2_config, ids = _read_source(src)
    name = name or default_name(src, dims)
    dest = check_destination(Path(out) if out is not None else imported_dir(cache_dir) / name)
    params = _parameter_count(f)
    check_free_space(dest, params * 4 * 2 + (64 << 20))  # float32, the embedding table in both decoders
    total, done = len(GRAPHS) + 2, 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    with staged_folder(dest) as folder:
        shutil.copyfile(src / "tokenizer.json", folder / "tokenizer.json")
        _write_configs(folder, dims, ct2_config, ids)
        step()
        onnx.save_model(build_encoder(dims, f.tensor), str(folder / GRAPHS[0]))
        step()
        onnx.save_model(build_decoder(dims, f.tensor, with_past=False), str(folder / GRAPHS[1]))
        step()
        onnx.save_model(build_decoder(dims, f.tensor, with_past=True), str(folder / GRAPHS[2]))
        step()
        source_sha = sha256_file(f.path)
        record = _import_record(src, f, name, folder, source_sha)
        (folder / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        step()
    details = {
        "import_s": round(time.monotonic() - started, 1),
        "d_model": dims.d_model,
        "encoder_layers": dims.encoder_layers,
        "decoder_layers": dims.decoder_layers,
        "vocab": dims.vocab,
        "languages": len(ids["langs"]),
        "parameters": params,
        "source_sha256": source_sha,
        "dtypes": f.dtypes(),
        "seconds": round(time.monotonic() - started, 1),
    }
    return ImportResult(name, dest, "ctranslate2-whisper", "whisper", details)


def _read_source(src: Path) -> tuple[Ct2File, Any, dict, dict]:
    """The folder's ``model.bin``, its ``WhisperDims``, CTranslate2's config with the suppressed ids checked
    (``suppress_ids_begin`` defaulted) and the special token ids read from the tokenizer."""
    if not (src / "tokenizer.json").is_file():
        raise ModelError(
            f"{src}: no tokenizer.json (a faster-whisper folder ships one; copy it from the model's source)"
        )
    config_path = src / "config.json"
    ct2_config = _read_config(config_path)
    f = Ct2File(src / "model.bin")
    dims = read_dims(f)
    lang_ids = _ids(ct2_config, "lang_ids", config_path, dims.vocab)
    ids = _token_ids(src / "tokenizer.json", lang_ids, dims.vocab)
    ct2_config = {
        **ct2_config,
        "suppress_ids": _ids(ct2_config, "suppress_ids", config_path, dims.vocab),
        "suppress_ids_begin": _ids(ct2_config, "suppress_ids_begin", config_path, dims.vocab, [220, ids["eot"]]),
    }
    return f, dims, ct2_config, ids


def _parameter_count(f: Ct2File) -> int:
    """How many weights ``model.bin`` holds (quantization scales not counted)."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int16": 2, "int32": 4}
    return sum(v.nbytes // itemsize.get(v.dtype, 1) for v in f.variables.values() if not v.name.endswith("_scale"))


def _import_record(src: Path, f: Ct2File, name: str, folder: Path, source_sha: str) -> dict:
    """``import.json`` (the same bytes for the same source and importer: it is part of the folder's hash, which
    keys its engines): the source folder, what was written from it."""
    return {
        "format": 1,
        "source": {
            "format": "ctranslate2-whisper",
            "folder": src.name,
            "file": "model.bin",
            "bytes": f.path.stat().st_size,
            "sha256": source_sha,
            "spec": f.spec,
            "spec_revision": f.revision,
            "binary_version": f.version,
            "dtypes": f.dtypes(),
        },
        "architecture": "whisper",
        "name": name,
        "weights": {"dtype": "float32", "files": {g: (folder / g).stat().st_size for g in GRAPHS}},
    }


def _write_configs(folder: Path, dims, ct2_config: dict, ids: dict) -> None:
    eot, sot = ids["eot"], ids["sot"]
    suppress = list(ct2_config["suppress_ids"])  # checked: token ids of the model
    begin = list(ct2_config["suppress_ids_begin"]) or [220, eot]
    task_to_id = {k: ids[k] for k in ("transcribe", "translate") if ids[k] is not None}
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "activation_function": "gelu",
        "d_model": dims.d_model,
        "encoder_layers": dims.encoder_layers,
        "encoder_attention_heads": dims.encoder_heads,
        "encoder_ffn_dim": dims.ffn,
        "decoder_layers": dims.decoder_layers,
        "decoder_attention_heads": dims.decoder_heads,
        "decoder_ffn_dim": dims.ffn,
        "num_mel_bins": dims.n_mels,
        "max_source_positions": dims.source_positions,
        "max_target_positions": dims.target_positions,
        "vocab_size": dims.vocab,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "suppress_tokens": suppress,
        "begin_suppress_tokens": begin,
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    generation = {
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "no_timestamps_token_id": ids["no_timestamps"],
        "is_multilingual": len(ids["langs"]) > 1,
        "lang_to_id": ids["langs"],
        "task_to_id": task_to_id,
        "suppress_tokens": suppress,
        "begin_suppress_tokens": begin,
        "max_length": dims.target_positions,
        "return_timestamps": False,
    }
    if ids["prev"] is not None:
        generation["prev_sot_token_id"] = ids["prev"]
    preprocessor = {
        "chunk_length": 30,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": dims.n_mels,
        "hop_length": 160,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
        "sampling_rate": 16000,
        "processor_class": "WhisperProcessor",
        # padded as faster-whisper pads (its log-mel, then zeros), the features this model is served with there
        "feature_padding": "log_mel",
    }
    for file, data in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("preprocessor_config.json", preprocessor),
    ):
        (folder / file).write_text(json.dumps(data, indent=2) + "\n")
