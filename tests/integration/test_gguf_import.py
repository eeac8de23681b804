"""The GGUF importer on tiny decoders of every supported architecture, against a numpy reference.

``tests/gguf_files.py`` writes each file the way llama.cpp's converter does (llama's permuted q/k rows,
Gemma's ``1 + w`` norms, phi3's fused weights, qwen2's biases, tensors as F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1);
``tests/gguf_reference.py`` computes the logits from the Hugging Face layout weights drawn before the
file was written, following transformers' modelling code. The imported ``model.onnx`` runs on ONNX
Runtime (and, for Gemma 3, OpenVINO CPU at f32, where ``logits_to_keep`` is folded to its default) and
must agree:

- one pass over a prompt longer than the sliding window, every position's logits;
- the same prompt in chunks with the KV cache carried and ``logits_to_keep = 1``;
- a left-padded batch of two prompts of different lengths, each row as the prompt alone.

Configurations beyond the real Gemma 3 270M: grouped query heads (4 over 2, 4 over 1), MHA, head sizes
other than hidden / heads, 7 Gemma 3 layers (layer 5 global, the rest sliding over 4 tokens), phi3's
sliding window, tied and untied heads, linear RoPE scaling, per-layer metadata arrays.

The tokenizer: ``tokenizer.json`` against sentencepiece's BPE (SentencePiece vocabularies) and GPT-2's
byte-level BPE with the file's split (byte-level ones), both written out in ``tests/gguf_reference.py``.

Bad files: each a ``ModelError`` naming the file, nothing at the destination; through the command line
one line on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tests.gguf_files import (
    Q,
    TinyConfig,
    add_vocab,
    gemma3_global,
    gpt2_vocab,
    make_weights,
    spm_vocab,
    write_gguf,
)
from tests.gguf_reference import byte_level_bpe_encode, reference_logits, spm_bpe_encode

# float32 on both sides over the same weights: the differences are summation order (ONNX Runtime's and
# OpenVINO's GEMMs and fused ops against numpy's) through at most 7 layers. Measured: at most 1.7e-5 on
# logits up to 56 in magnitude, over every architecture and path below.
LOGIT_TOL = 1e-4

CONFIGS = {
    "gemma3": TinyConfig(
        "gemma3", layers=7, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, vocab=spm_vocab(), tied=True,
        rope_base=1_000_000.0, window=4, seed=1,
        types={
            "token_embd": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.Q4_1, "ffn_up": Q.Q8_0,
            "ffn_down": Q.F16,
        },
    ),
    "llama": TinyConfig(
        "llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=spm_vocab(), tied=False,
        eps=1e-5, seed=2, types={
            "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "output": Q.F16, "ffn_gate": Q.Q8_0,
            "ffn_down": Q.BF16,
        },
    ),
    "qwen2": TinyConfig(
        "qwen2", layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=96, vocab=gpt2_vocab(), tied=True,
        rope_base=1_000_000.0, seed=3, types={"token_embd": Q.F16, "attn_v": Q.Q8_0, "ffn_gate": Q.Q5_0},
    ),
    "qwen3": TinyConfig(
        "qwen3", layers=2, hidden=64, heads=4, kv_heads=1, head_dim=32, ffn=96, vocab=gpt2_vocab(), tied=False,
        seed=4, types={"attn_k": Q.Q8_0, "output": Q.Q8_0, "ffn_down": Q.F16}, per_layer_arrays=True,
    ),
    "phi3": TinyConfig(
        "phi3", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=spm_vocab(), tied=False,
        eps=1e-5, window=5, seed=5, types={"attn_q": Q.Q8_0, "ffn_up": Q.F16, "attn_output": Q.Q5_1},
    ),
}  # fmt: skip
PROMPT_LEN = 11  # longer than every window above


@dataclass
class Imported:
    cfg: TinyConfig
    weights: dict[str, np.ndarray]
    folder: Path
    session: object


def _import(cfg: TinyConfig, root: Path) -> tuple[dict[str, np.ndarray], Path]:
    from edge_agent.importers import import_model

    weights = make_weights(cfg)
    src = write_gguf(root / f"tiny-{cfg.arch}.gguf", cfg, weights)
    result = import_model(src, root / cfg.arch, root / "cache")
    assert result.architecture == cfg.arch
    return weights, result.path


def _session(folder: Path, backend: str = "onnxruntime", device: str = "cpu"):
    from edge_agent.backends import SessionOptions, open_session

    return open_session(folder / "model.onnx", backend, SessionOptions(device=device, threads=1))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def imported(request, tmp_path_factory) -> Imported:
    cfg = CONFIGS[request.param]
    weights, folder = _import(cfg, tmp_path_factory.mktemp(cfg.arch))
    session = _session(folder)
    yield Imported(cfg, weights, folder, session)
    session.close()


def _prompt(cfg: TinyConfig, n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    return np.random.default_rng(100 + seed).integers(0, cfg.n_vocab, size=n).tolist()


def _empty_past(cfg: TinyConfig, batch: int = 1) -> dict[str, np.ndarray]:
    empty = np.zeros((batch, cfg.kv_heads, 0, cfg.head_dim), dtype=np.float32)
    return {f"past_key_values.{i}.{kv}": empty for i in range(cfg.layers) for kv in ("key", "value")}


def _run(session, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: dict, keep: int | None = None):
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
    if keep is not None:
        feeds["logits_to_keep"] = np.array(keep, dtype=np.int64)
    out = session.run(feeds)
    present = {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if k.startswith("present.")}
    return out["logits"], present


def _one_pass(session, cfg: TinyConfig, ids: list[int]) -> np.ndarray:
    n = len(ids)
    logits, _ = _run(
        session,
        np.asarray([ids], dtype=np.int64),
        np.ones((1, n), dtype=np.int64),
        np.arange(n, dtype=np.int64)[None],
        _empty_past(cfg),
    )
    return logits[0]


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _check_one_pass(session, cfg: TinyConfig, weights: dict[str, np.ndarray]) -> None:
    ids = _prompt(cfg)
    want = reference_logits(cfg, weights, ids)
    got = _one_pass(session, cfg, ids)
    assert got.shape == (PROMPT_LEN, cfg.n_vocab)
    assert np.abs(want).max() > 1.0  # logits large enough for the tolerance to mean something
    assert _max_diff(got, want) < LOGIT_TOL


def _check_chunked(session, cfg: TinyConfig, weights: dict[str, np.ndarray], keep: int | None = 1) -> None:
    ids = _prompt(cfg, seed=1)
    want = reference_logits(cfg, weights, ids)
    past, done = _empty_past(cfg), 0
    for size in (3, 4, 1, 3):  # chunk boundaries inside and across every window
        chunk = ids[done : done + size]
        logits, past = _run(
            session,
            np.asarray([chunk], dtype=np.int64),
            np.ones((1, done + size), dtype=np.int64),
            np.arange(done, done + size, dtype=np.int64)[None],
            past,
            keep=keep,
        )
        done += size
        assert logits.shape == (1, keep or size, cfg.n_vocab)
        assert _max_diff(logits[0, -1], want[done - 1]) < LOGIT_TOL, f"after {done} tokens"
        assert past["past_key_values.0.key"].shape == (1, cfg.kv_heads, done, cfg.head_dim)
    assert done == len(ids)


def _check_left_padded(session, cfg: TinyConfig, weights: dict[str, np.ndarray]) -> None:
    long, short = _prompt(cfg, seed=2), _prompt(cfg, n=6, seed=3)
    pad = len(long) - len(short)
    ids = np.asarray([long, [0] * pad + short], dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :pad] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    logits, present = _run(session, ids, mask, positions, _empty_past(cfg, batch=2))
    assert _max_diff(logits[0], reference_logits(cfg, weights, long)) < LOGIT_TOL
    assert _max_diff(logits[1, pad:], reference_logits(cfg, weights, short)) < LOGIT_TOL
    # one decode step each, the padded cache carried
    nxt = np.asarray([[5], [7]], dtype=np.int64)
    mask2 = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
    step, _ = _run(session, nxt, mask2, positions[:, -1:] + 1, present)
    assert _max_diff(step[0, 0], reference_logits(cfg, weights, [*long, 5])[-1]) < LOGIT_TOL
    assert _max_diff(step[1, 0], reference_logits(cfg, weights, [*short, 7])[-1]) < LOGIT_TOL


def test_one_pass_logits_equal_the_reference_at_every_position(imported):
    _check_one_pass(imported.session, imported.cfg, imported.weights)


def test_chunked_prefill_with_the_cache_carried_equals_the_reference(imported):
    _check_chunked(imported.session, imported.cfg, imported.weights)


def test_left_padded_batch_rows_equal_each_prompt_alone(imported):
    _check_left_padded(imported.session, imported.cfg, imported.weights)


def test_importing_the_same_file_again_writes_the_same_folder(imported, tmp_path, monkeypatch):
    """The folder's hash keys its engines: a second import of the same file (``models fetch`` again) must
    not make every engine built from the first one a miss, however long it took."""
    import itertools

    import edge_agent.importers.gguf as gguf_importer
    from edge_agent.engines.cache import hash_model
    from edge_agent.importers import import_model

    ticks = itertools.count(1000.0, 7.5)  # a slow import: every clock reading 7.5 s after the last
    monkeypatch.setattr(gguf_importer.time, "monotonic", lambda: next(ticks))

    cfg = imported.cfg
    (tmp_path / "src").mkdir()
    src = write_gguf(tmp_path / "src" / f"tiny-{cfg.arch}.gguf", cfg, imported.weights)  # the same file again
    again = import_model(src, tmp_path / cfg.arch, tmp_path / "cache")
    assert again.details["import_s"] >= 7.5  # the import's time is reported, not written into the folder
    assert hash_model(again.path) == hash_model(imported.folder)


def test_config_json_describes_the_decoder(imported):
    cfg = imported.cfg
    config = json.loads((imported.folder / "config.json").read_text())
    assert config["num_hidden_layers"] == cfg.layers
    assert config["num_attention_heads"] == cfg.heads
    assert config["num_key_value_heads"] == cfg.kv_heads
    assert config["head_dim"] == cfg.head_dim
    assert config["vocab_size"] == cfg.n_vocab
    assert config["tie_word_embeddings"] == cfg.tied
    if cfg.arch == "gemma3":
        want = ["full_attention" if gemma3_global(i) else "sliding_attention" for i in range(cfg.layers)]
        assert config["layer_types"] == want
        assert config["sliding_window"] == cfg.window
        assert config["rope_theta"] == cfg.rope_base
    record = json.loads((imported.folder / "import.json").read_text())
    stored = {t.name for t in cfg.types.values()} | {"F32"}
    assert set(record["source"]["block_types"]) == stored


def test_gemma3_on_openvino_cpu_equals_the_reference(tmp_path):
    pytest.importorskip("openvino")
    cfg = CONFIGS["gemma3"]
    weights, folder = _import(cfg, tmp_path)
    # precision "auto" pins INFERENCE_PRECISION_HINT=f32 (backends/openvino.py), so no silent bf16
    session = _session(folder, "openvino", "CPU")
    try:
        _check_one_pass(session, cfg, weights)
        _check_chunked(session, cfg, weights, keep=None)  # OpenVINO folds logits_to_keep to its default
        _check_left_padded(session, cfg, weights)
    finally:
        session.close()


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_linear_rope_scaling(arch, tmp_path):
    # Gemma 3 4B and up scale the global layers' RoPE linearly (factor 8); the local layers stay unscaled
    cfg = replace(CONFIGS[arch], rope_linear=8.0)
    weights, folder = _import(cfg, tmp_path)
    session = _session(folder)
    try:
        ids = _prompt(cfg)
        got = _one_pass(session, cfg, ids)
        assert _max_diff(got, reference_logits(cfg, weights, ids)) < LOGIT_TOL
        assert _max_diff(got, reference_logits(replace(cfg, rope_linear=1.0), weights, ids)) > 100 * LOGIT_TOL
    finally:
        session.close()
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}


# --- the tokenizer -------------------------------------------------------------------------------

TEXTS = [
    "the water boils",
    "hello world and the oil is cold",
    "standing, boiling: is it?",
    "Water boils at 100 degrees!",
    "héllo wörld 🙂 日本",
    "x",
    "tab\tand\nnewline",
    "two  spaces",
    " a leading space",
]


def _spm_reference(vocab, text: str, dummy_prefix: bool) -> list[int]:
    pieces = {t: i for i, t in enumerate(vocab.tokens)}
    scores = {t: s for t, s, k in zip(vocab.tokens, vocab.scores, vocab.types) if k == 1}
    return spm_bpe_encode(text, pieces, scores, dummy_prefix)


@pytest.mark.parametrize(("arch", "space_prefix"), [("llama", None), ("llama", False), ("gemma3", None)])
def test_sentencepiece_tokenizer_equals_sentencepiece_bpe_and_round_trips(arch, space_prefix, tmp_path):
    from tokenizers import Tokenizer

    vocab = replace(CONFIGS[arch].vocab, space_prefix=space_prefix)
    cfg = replace(CONFIGS[arch], layers=1, vocab=vocab)
    _, folder = _import(cfg, tmp_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # Gemma's sentencepiece model adds no dummy prefix; Llama's does unless the file says otherwise
    dummy_prefix = arch != "gemma3" and space_prefix is not False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == _spm_reference(vocab, text, dummy_prefix), text
        assert tok.decode(ids) == text
        with_bos = tok.encode(text).ids
        assert with_bos == [vocab.bos, *ids]
        assert tok.decode(with_bos, skip_special_tokens=True) == text
    # control and user-defined tokens are one id each, never split
    end, tool = vocab.id("<|end|>"), vocab.id("<|tool|>")
    ids = tok.encode("the water<|end|>", add_special_tokens=False).ids
    assert ids == [*_spm_reference(vocab, "the water", dummy_prefix), end]
    assert tok.encode("<|tool|>", add_special_tokens=False).ids == [tool]
    # text after a special token starts a new piece of text: llama.cpp gives it the dummy prefix too
    ids = tok.encode("<|end|>the water<|tool|>is cold", add_special_tokens=False).ids
    spm = [_spm_reference(vocab, t, dummy_prefix) for t in ("the water", "is cold")]
    assert ids == [end, *spm[0], tool, *spm[1]]
    assert tok.decode([*_spm_reference(vocab, "hello", dummy_prefix), end], skip_special_tokens=True) == "hello"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", True)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_byte_level_tokenizer_equals_byte_level_bpe_with_the_files_split(pre, tmp_path):
    from tokenizers import Tokenizer

    vocab = replace(gpt2_vocab(), pre=pre)
    cfg = replace(CONFIGS["qwen2"], layers=1, vocab=vocab)
    _, folder = _import(cfg, tmp_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids_of = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    texts = [
        "the and then",
        "hand in hand 12345 and 7",
        "don't stop, THEN!\n\n  go",
        "héllo 🙂 wörld",
        "  two  spaces ",
    ]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == byte_level_bpe_encode(text, pre, ids_of, merges), text
        assert tok.decode(ids) == text
    start, end = vocab.id("<|im_start|>"), vocab.id("<|im_end|>")
    ids = tok.encode("<|im_start|>the hand<|im_end|>", add_special_tokens=False).ids
    assert ids == [start, *byte_level_bpe_encode("the hand", pre, ids_of, merges), end]


# --- bad files -----------------------------------------------------------------------------------


def _good_file(path: Path, **changes) -> Path:
    cfg = replace(CONFIGS["llama"], layers=1, **changes)
    return write_gguf(path, cfg, make_weights(cfg))


def _expect_refused(src: Path, tmp_path: Path, *needles: str) -> str:
    from edge_agent.errors import ModelError
    from edge_agent.importers import import_model

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with pytest.raises(ModelError) as err:
        import_model(src, out / "model", tmp_path / "cache")
    message = str(err.value)
    assert str(src) in message
    for needle in needles:
        assert needle in message, message
    assert list(out.iterdir()) == []  # no folder, no .model.importing-* staging folder
    assert not (tmp_path / "cache" / "imported").exists()
    return message


def _truncate(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


def test_truncated_in_the_tensor_data(tmp_path):
    good = _good_file(tmp_path / "good.gguf")
    bad = _truncate(good, tmp_path / "cut-data.gguf", good.stat().st_size - 1000)
    _expect_refused(bad, tmp_path, "truncated")


def test_truncated_in_the_header(tmp_path):
    good = _good_file(tmp_path / "good.gguf")
    for size in (6, 30, 400):
        _expect_refused(_truncate(good, tmp_path / f"cut-{size}.gguf", size), tmp_path)


def test_garbage_after_the_magic(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8).tobytes())
    _expect_refused(bad, tmp_path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is a text file\n")
    _expect_refused(bad, tmp_path, "not a GGUF")


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    import gguf

    bad = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(bad), "mamba")
    writer.add_block_count(1)
    add_vocab(writer, spm_vocab())
    writer.add_tensor("token_embd.weight", np.zeros((len(spm_vocab().tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _expect_refused(bad, tmp_path, "'mamba'", "gemma3, llama, qwen2, qwen3, phi3")


def test_vocabulary_size_differs_from_the_embedding_rows(tmp_path):
    vocab = spm_vocab()
    cfg = replace(CONFIGS["llama"], layers=1)
    weights = make_weights(cfg)
    short = replace(vocab, tokens=vocab.tokens[:-1], scores=vocab.scores[:-1], types=vocab.types[:-1])
    bad = write_gguf(tmp_path / "vocab.gguf", replace(cfg, vocab=short), weights)
    _expect_refused(bad, tmp_path, f"{len(vocab.tokens) - 1:,} tokens", f"{len(vocab.tokens):,} rows")


def test_no_tokenizer_metadata(tmp_path, monkeypatch):
    import tests.gguf_files as files

    monkeypatch.setattr(files, "add_vocab", lambda writer, vocab: None)
    _expect_refused(_good_file(tmp_path / "no-vocab.gguf"), tmp_path, "tokenizer")


def test_block_type_the_gguf_package_cannot_dequantize(tmp_path, monkeypatch):
    import gguf

    # Q8_1 is a block type GGUF can hold (llama.cpp's intermediate for dot products) but no converter
    # writes and the gguf package has no dequantizer for: raw blocks of the right size stand in for it.
    cfg = replace(CONFIGS["llama"], layers=1)
    weights = make_weights(cfg)
    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
        if name == "blk.0.attn_output.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            rows, cols = tensor.shape
            blocks = np.zeros((rows, cols // block * size), dtype=np.uint8)
            return real_add(self, name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        return real_add(self, name, tensor, raw_shape, raw_dtype, tensor_endianess)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    bad = write_gguf(tmp_path / "q8_1.gguf", cfg, weights)
    monkeypatch.undo()
    _expect_refused(bad, tmp_path, "Q8_1", "blk.0.attn_output.weight")


def test_cli_refuses_a_bad_file_with_one_line(tmp_path):
    good = _good_file(tmp_path / "good.gguf")
    bad = _truncate(good, tmp_path / "bad.gguf", good.stat().st_size - 1000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env.update({"CACHE_DIRECTORY": str(tmp_path / "cache"), "STATE_DIRECTORY": str(tmp_path / "state")})
    run = subprocess.run(
        [sys.executable, "-m", "edge_agent", "models", "import", str(bad), "--out", str(tmp_path / "out" / "m")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert str(bad) in lines[0]
    assert not (tmp_path / "out" / "m").exists()


def test_byte_level_merges_naming_a_token_not_in_the_vocabulary(tmp_path):
    vocab = gpt2_vocab()
    cfg = replace(CONFIGS["qwen2"], layers=1, vocab=replace(vocab, merges=[*vocab.merges, "Ġw ater"]))
    bad = write_gguf(tmp_path / "merges.gguf", cfg, make_weights(cfg))
    _expect_refused(bad, tmp_path, "merges")


@pytest.mark.parametrize("key", ["unk", "bos", "eos"])
def test_special_token_id_outside_the_vocabulary(tmp_path, key):
    vocab = spm_vocab()
    cfg = replace(CONFIGS["llama"], layers=1, vocab=replace(vocab, **{key: len(vocab.tokens)}))
    bad = write_gguf(tmp_path / f"{key}.gguf", cfg, make_weights(cfg))
    _expect_refused(bad, tmp_path, f"{len(vocab.tokens)}", "outside the vocabulary")


def test_partial_rotary_embeddings(tmp_path, monkeypatch):
    import gguf

    # phi2-style partial RoPE: the decoder graph rotates whole heads only
    def half_rotary(writer, n: int) -> None:
        writer.add_uint32("phi3.rope.dimension_count", n // 2)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", half_rotary)
    cfg = replace(CONFIGS["phi3"], layers=1)
    bad = write_gguf(tmp_path / "partial-rope.gguf", cfg, make_weights(cfg))
    _expect_refused(bad, tmp_path, "rotary")


def test_query_heads_that_do_not_group_over_the_kv_heads(tmp_path):
    cfg = replace(CONFIGS["qwen2"], layers=1, heads=4, kv_heads=3, head_dim=16)
    bad = write_gguf(tmp_path / "heads.gguf", cfg, make_weights(cfg))
    _expect_refused(bad, tmp_path, "4 query heads", "3 KV heads")


def test_tensor_shape_that_the_metadata_contradicts(tmp_path):
    # the K and V projections of 4 KV heads under metadata saying 2: a graph built from it would fail at
    # its first run, not at import
    cfg = replace(CONFIGS["qwen2"], layers=1, kv_heads=2)
    bad = write_gguf(tmp_path / "shapes.gguf", cfg, make_weights(replace(cfg, kv_heads=4)))
    _expect_refused(bad, tmp_path, "blk.0.attn_k.weight", "[64, 64]", "[32, 64]")


def test_failed_import_over_an_existing_folder_keeps_it(tmp_path, monkeypatch):
    from edge_agent.errors import ModelError
    from edge_agent.importers import import_model

    out = tmp_path / "out"
    good = _good_file(tmp_path / "good.gguf")
    import_model(good, out / "model", tmp_path / "cache")
    before = {p.name: p.read_bytes() for p in (out / "model").iterdir()}
    from edge_agent.importers.gguf_file import GgufFile

    def unreadable(self, name: str):
        raise ModelError(f"{self.path}: tensor {name!r} cannot be read")

    # fails once the staging folder holds the tokenizer, configs and the weights file
    monkeypatch.setattr(GgufFile, "tensor", unreadable)
    with pytest.raises(ModelError, match="cannot be read"):
        import_model(good, out / "model", tmp_path / "cache")
    assert [p.name for p in out.iterdir()] == ["model"]  # no .model.importing-* left
    assert {p.name: p.read_bytes() for p in (out / "model").iterdir()} == before


def test_head_counts_that_differ_between_layers(tmp_path, monkeypatch):
    import gguf

    real = gguf.GGUFWriter.add_head_count_kv

    def varying(writer, counts) -> None:
        real(writer, [counts[0], counts[0] // 2])

    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv", varying)
    cfg = replace(CONFIGS["qwen3"], layers=2, kv_heads=2)
    bad = write_gguf(tmp_path / "varying.gguf", cfg, make_weights(cfg))
    _expect_refused(bad, tmp_path, "attention.head_count_kv", "differs between layers")
