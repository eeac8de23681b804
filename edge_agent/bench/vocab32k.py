"""A Phi-3-sized tokenizer for benchmarks that need a realistic vocabulary when no model hub is reachable.

``load_or_train`` returns a Llama/Phi-3-style BPE ``tokenizer.json`` (byte fallback ``<0x00>``…``<0xFF>`` at ids
3–258, the ``▁`` metaspace, ``<unk>`` ``<s>`` ``</s>`` at 0–2, 32,000 model tokens, then Phi-3's chat tokens
``<|endoftext|>`` … ``<|user|>`` at 32,000–32,010: 32,011 tokens, padded by the model to 32,064 logits).
It is trained once with the HF ``tokenizers`` library on text found on this machine (the running Python's
standard library sources, and the documentation and JSON files of its site-packages) and cached under the
user's cache directory. ``token_bytes`` gives each id's bytes for engines that take a vocabulary list, and
``continuation_ids`` tokenizes text as a model would generate it after a prompt (no leading ``▁``).
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import InputError

VOCAB_SIZE = 32_000  # the model's own tokens, as Llama-2 / Phi-3
N_LOGITS = 32_064  # Phi-3-mini's lm_head (the vocabulary padded to a multiple of 64)
BASE_SPECIALS = ("<unk>", "<s>", "</s>")
# Phi-3-mini's added tokens, in id order from 32,000
PHI3_ADDED = (
    "<|endoftext|>",
    "<|assistant|>",
    "<|placeholder1|>",
    "<|placeholder2|>",
    "<|placeholder3|>",
    "<|placeholder4|>",
    "<|system|>",
    "<|end|>",
    "<|placeholder5|>",
    "<|placeholder6|>",
    "<|user|>",
)
CACHE_VERSION = 1
_TEXT_SUFFIXES = (".md", ".rst", ".txt", ".json")


def corpus_files(budget_bytes: int = 24_000_000) -> list[Path]:
    """Text files on this machine, in a stable order: Python sources of the standard library first, then
    documentation and JSON of the installed packages, up to about ``budget_bytes``."""
    paths = sysconfig.get_paths()
    roots = [(Path(paths["stdlib"]), (".py",)), (Path(paths["purelib"]), _TEXT_SUFFIXES)]
    picked: list[Path] = []
    total = 0
    for root, suffixes in roots:
        if not root.is_dir():
            continue
        share = budget_bytes * (2 if suffixes == (".py",) else 1) // 3
        used = 0
        for f in sorted(p for p in root.rglob("*") if p.suffix in suffixes and "test" not in p.parts):
            try:
                size = f.stat().st_size
            except OSError:
                continue
            if 0 < size < 2_000_000 and used + size <= share:
                picked.append(f)
                used += size
        total += used
    if total < 1_000_000:
        raise InputError(f"too little text to train a tokenizer on this machine ({total} bytes under {roots})")
    return picked


def _lines(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            yield from f.read_text(encoding="utf-8", errors="ignore").splitlines()
        except OSError:
            continue


def train(lines: Iterable[str], vocab_size: int = VOCAB_SIZE, added: tuple[str, ...] = PHI3_ADDED) -> str:
    """Train the tokenizer on ``lines`` of text and return its ``tokenizer.json`` text (Llama/Phi-3 layout:
    ``vocab_size`` model tokens, the byte tokens among them, then ``added`` as special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[*BASE_SPECIALS, *byte_tokens],
        limit_alphabet=1000,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    data = json.loads(tok.to_str())
    # The byte tokens are model tokens in Llama's layout, not added tokens matched in raw text.
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in BASE_SPECIALS]
    tok = Tokenizer.from_str(json.dumps(data))
    if tok.get_vocab_size() != vocab_size:
        raise InputError(f"trained tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}: corpus too small")
    tok.add_special_tokens(list(added))
    return tok.to_str()


def load_or_train(cache_dir: Path | None = None, log: Callable[[str], None] | None = None) -> tuple[str, Path]:
    """The cached 32k tokenizer's JSON text and path, training it first (a minute or two) when absent."""
    if cache_dir is None:
        from ..config.base import default_cache_dir

        cache_dir = default_cache_dir() / "bench"
    files = corpus_files()
    key = hashlib.sha256(f"{CACHE_VERSION}\n{sys.version_info[:2]}\n{len(files)}".encode()).hexdigest()[:10]
    path = cache_dir / f"vocab32k-{key}.json"
    if path.is_file():
        return path.read_text(encoding="utf-8"), path
    if log:
        log(f"training a {VOCAB_SIZE}-token BPE tokenizer on {len(files)} local files (once; cached in {path})")
    text = train(_lines(files))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return text, path


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's printable stand-ins for the 256 bytes (what ByteLevel vocabularies are written in)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer_json: str) -> bool:
    """Whether the vocabulary is written in GPT-2's byte-level alphabet (else SentencePiece's ``▁`` style)."""
    data = json.loads(tokenizer_json)
    return "ByteLevel" in json.dumps([data.get("pre_tokenizer"), data.get("decoder")])


def token_bytes(tokenizer_json: str) -> dict[int, bytes]:
    """The bytes each model token stands for (``▁`` → space, ``<0x0A>`` → newline, byte-level letters → bytes);
    added (special) tokens are left out."""
    data = json.loads(tokenizer_json)
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    out: dict[int, bytes] = {}
    if is_byte_level(tokenizer_json):
        table = _byte_level_decoder()
        for text, i in vocab.items():
            if i not in special:
                out[i] = bytes(table.get(ch, 0) for ch in text)
        return out
    for text, i in vocab.items():
        if i in special:
            continue
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out[i] = bytes([int(text[3:5], 16)])
        else:
            out[i] = text.replace("▁", " ").encode("utf-8")
    return out


def continuation_ids(tokenizer, text: str, prefixes: tuple[str, ...] = ("<|assistant|>\n", "\n")) -> list[int]:
    """``text`` tokenized as a model generates it after a prompt: the ids of ``prefix + text`` after those of
    ``prefix``, for the first of ``prefixes`` where the split falls exactly between the two and the rest
    decodes to ``text``. Raises ``InputError`` when none does."""
    for prefix in prefixes:
        head = tokenizer.encode(prefix, add_special_tokens=False).ids
        ids = tokenizer.encode(prefix + text, add_special_tokens=False).ids
        rest = ids[len(head) :]
        if ids[: len(head)] == head and tokenizer.decode(rest, skip_special_tokens=False) == text:
            return rest
    raise InputError(f"the tokenizer does not split any of {prefixes!r} from the text {text[:40]!r}…")
