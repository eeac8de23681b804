"""The GGUF importer on small crafted files a hostile user or a broken converter could hand it: counts and
lengths past the end of the file, a ``block_count`` of billions, metadata values of the wrong kind or range,
a vocabulary token of 400,000 characters, things that are not regular files. Each is one ``ModelError``
naming the file (through the command line: one line, exit 1) in bounded time and memory; the cases that
once took the machine's memory run in a subprocess under a data-size limit, so a regression fails the
test instead of the machine."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from tests.conftest import REPO
from tests.gguf_files import TinyConfig, make_weights, spm_vocab, write_gguf

V = gguf.GGUFValueType
LLAMA = TinyConfig("llama", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, vocab=spm_vocab(), tied=True)
GEMMA = TinyConfig(
    "gemma3", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, vocab=spm_vocab(), tied=True, window=4
)
LIMIT_MB = 1024  # the subprocess's data segment: an import of these files needs a small fraction of it


def crafted(path: Path, cfg: TinyConfig, **overrides: tuple) -> Path:
    """A tiny model of ``cfg`` with some metadata replaced: ``key=(value, type[, item type])``; dots in a key
    are spelled ``__``."""
    real = gguf.GGUFWriter.add_key_value
    want = {k.replace("__", "."): v for k, v in overrides.items()}

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key in want:
            val, vtype, *rest = want[key]
            sub_type = rest[0] if rest else None
        real(self, key, val, vtype, sub_type)

    gguf.GGUFWriter.add_key_value = add_key_value
    try:
        return write_gguf(path, cfg, make_weights(cfg))
    finally:
        gguf.GGUFWriter.add_key_value = real


def header(n_tensors: int = 0, n_kv: int = 1, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def gstr(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def refused(src: Path, tmp_path: Path, *needles: str) -> str:
    from edge_agent.errors import ModelError
    from edge_agent.importers import import_model

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with pytest.raises(ModelError) as err:
        import_model(src, out / "model", tmp_path / "cache")
    message = str(err.value)
    assert str(src) in message and "\n" not in message
    for needle in needles:
        assert needle in message, message
    assert list(out.iterdir()) == []
    return message


def cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``edge-agent ARGS`` in a subprocess whose data segment is limited to ``LIMIT_MB``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env.update({"CACHE_DIRECTORY": str(tmp_path / "cache"), "STATE_DIRECTORY": str(tmp_path / "state")})
    limit = (
        f"import resource; resource.setrlimit(resource.RLIMIT_DATA, ({LIMIT_MB << 20}, {LIMIT_MB << 20})); "
        "import sys, runpy; sys.argv = ['edge-agent', *sys.argv[1:]]; "
        "runpy.run_module('edge_agent', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", limit, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def one_line(run: subprocess.CompletedProcess, *needles: str) -> str:
    assert run.returncode == 1, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- counts and lengths past the end: refused before anything is allocated -------------------------


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (header() + gstr("x") + struct.pack("<IIQ", V.ARRAY, V.UINT8, 1 << 40), "needs 1,099,511,627,776 bytes"),
        (header() + gstr("x") + struct.pack("<IIQ", V.ARRAY, V.STRING, 1 << 40), "needs 8,796,093,022,208 bytes"),
        (header() + gstr("x") + struct.pack("<IQ", V.STRING, 1 << 62), "needs"),
        (header() + struct.pack("<Q", 1 << 50), "needs"),  # a key's length
        (header(n_kv=1 << 60), "1,152,921,504,606,846,976 metadata keys"),
        (header(n_tensors=1 << 40, n_kv=0), "1,099,511,627,776 tensors"),
        (header(n_tensors=1, n_kv=0) + gstr("t") + struct.pack("<I", 1 << 30), "dimensions"),
        (header(n_tensors=1, n_kv=0) + gstr("t") + struct.pack("<IQQIQ", 2, 1 << 32, 1 << 32, 0, 0), "ends at byte"),
        (header(version=1 << 31), "GGUF version 2147483648"),
    ],
    ids=["uint8-array", "string-array", "string", "key", "key-count", "tensor-count", "dims", "tensor-size", "version"],
)
def test_declared_counts_past_the_end_are_refused_in_bounded_memory(tmp_path, body, said):
    src = tmp_path / "bad.gguf"
    src.write_bytes(body)
    one_line(cli(tmp_path, "models", "import", str(src), "--out", str(tmp_path / "m"), timeout=60), str(src), said)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("cfg", [GEMMA, LLAMA], ids=["gemma3", "llama"])
def test_a_block_count_of_billions_is_refused_against_the_tensors_present(tmp_path, cfg):
    src = crafted(tmp_path / "blocks.gguf", cfg, **{f"{cfg.arch}__block_count": (2**32 - 1, V.UINT32)})
    line = one_line(cli(tmp_path, "models", "import", str(src), "--out", str(tmp_path / "m"), timeout=60))
    assert f"{cfg.arch}.block_count is 4,294,967,295" in line and "tensors of 1 blocks" in line


# -- metadata of the wrong kind or range ------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("attention.head_count", (0, V.UINT32), "attention.head_count is 0; it must be an integer in 1.."),
        ("attention.head_count_kv", (0, V.UINT32), "attention.head_count_kv is 0; it must be an integer in 1..2"),
        ("block_count", (0, V.UINT32), "block_count is 0; it must be an integer in 1.."),
        ("block_count", (-1, V.INT32), "block_count is -1; it must be an integer in 1.."),
        ("block_count", ("one", V.STRING), "block_count is 'one'; it must be an integer"),
        ("attention.layer_norm_rms_epsilon", ("1e-6", V.STRING), "epsilon is '1e-6'; it must be a number above 0"),
        ("attention.layer_norm_rms_epsilon", (-1.0, V.FLOAT32), "epsilon is -1.0; it must be a number above 0"),
        ("context_length", ("4096", V.STRING), "context_length is '4096'; it must be an integer in 1.."),
        ("context_length", (0, V.UINT32), "context_length is 0"),
        ("embedding_length", (1.5, V.FLOAT32), "embedding_length is 1.5"),
        ("rope.freq_base", (float("nan"), V.FLOAT32), "rope.freq_base is nan"),
        ("feed_forward_length", ([48, 48, 48], V.ARRAY, V.UINT32), "feed_forward_length has 3 values for 1 layers"),
        ("attention.head_count", ([2.0], V.ARRAY, V.FLOAT32), "head_count holds float32 values"),
    ],
)
def test_metadata_of_the_wrong_kind_or_range_names_the_key_and_what_is_allowed(tmp_path, key, value, said):
    src = crafted(tmp_path / "bad.gguf", LLAMA, **{f"llama__{key.replace('.', '__')}": value})
    refused(src, tmp_path, f"llama.{key}" if "epsilon" not in key else "epsilon", said)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("tokenizer.ggml.bos_token_id", ("1", V.STRING), "tokenizer.ggml.bos_token_id is '1', outside the vocab"),
        ("tokenizer.ggml.token_type", ([1, 2], V.ARRAY, V.INT32), "token_type has 2 items for"),
        ("tokenizer.ggml.scores", ("x", V.STRING), "tokenizer.ggml.scores is 'x'; it must be an array of numbers"),
        ("tokenizer.ggml.tokens", ([1, 2], V.ARRAY, V.UINT8), "tokenizer.ggml.tokens is [1, 2]; it must be an array"),
        ("tokenizer.ggml.add_bos_token", (7, V.UINT8), "add_bos_token is 7; it must be true or false"),
        ("tokenizer.ggml.model", (3, V.UINT32), "tokenizer model 3 is not supported"),
    ],
)
def test_tokenizer_metadata_of_the_wrong_kind_is_one_line(tmp_path, key, value, said):
    src = crafted(tmp_path / "bad.gguf", LLAMA, **{key.replace(".", "__"): value})
    refused(src, tmp_path, said)


def test_a_long_vocabulary_token_costs_linear_work(tmp_path):
    """The merges recovered from a SentencePiece vocabulary: a 400,000-character token is cut only where both
    sides can be tokens, so the characters sliced stay a small multiple of its length (all cuts: 8e10)."""
    from edge_agent.importers.gguf_tokenizer import _sentencepiece_merges

    sliced = [0]

    class Counted(str):
        def __getitem__(self, key):
            part = str.__getitem__(self, key)
            sliced[0] += len(part)
            return part

    long = Counted("a" * 400_000)
    tokens = ["a", "aa", "aaa", "b", "ab"]
    merges = _sentencepiece_merges([*tokens, long], {t: -i for i, t in enumerate([*tokens, long])})
    assert ("a", "a") in merges and ("aa", "a") in merges and ("a", "b") in merges
    assert sliced[0] <= 10 * len(long), sliced[0]


def test_the_merges_found_are_every_split_into_two_tokens():
    from edge_agent.importers.gguf_tokenizer import _sentencepiece_merges

    tokens = ["a", "b", "c", "ab", "bc", "abc", "abcab"]
    got = set(_sentencepiece_merges(tokens, {t: 0.0 for t in tokens}))
    want = {(p[:i], p[i:]) for p in tokens for i in range(1, len(p)) if p[:i] in tokens and p[i:] in tokens}
    assert got == want


# -- what is not a regular file ---------------------------------------------------------------------


def test_a_fifo_or_a_device_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for src in (fifo, Path("/dev/zero")):
        refused(src, tmp_path, "not a regular file")


def test_an_unreadable_file_is_one_line(tmp_path):
    refused(Path("/proc/self/mem"), tmp_path, "cannot read")


def test_a_tiny_model_still_imports(tmp_path):
    from edge_agent.importers import import_model

    src = crafted(tmp_path / "ok.gguf", replace(LLAMA, layers=2))
    result = import_model(src, tmp_path / "out", tmp_path / "cache")
    assert result.details["layers"] == 2 and (result.path / "model.onnx").is_file()
