"""A ``tokenizer.json`` (Hugging Face ``tokenizers``) rebuilt from a GGUF's own vocabulary.

A GGUF stores the tokenizer as metadata: ``tokenizer.ggml.model`` (``llama`` = SentencePiece BPE with
byte fallback, ``gpt2`` = byte-level BPE), the tokens, their scores and types (1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte), merges for byte-level vocabularies, and the special ids.

- SentencePiece vocabularies list no merges: they are recovered from the vocabulary itself, every
  split of a token into two tokens of the vocabulary being a merge, ranked by the merged token's
  priority. For Gemma that priority is the token's position in the file (Gemma's scores do not follow
  its merge order); for other SentencePiece models it is the token's score. Gemma files also spell a
  token of several spaces with real spaces, where the tokenizer looks for ``▁``: respelled here.
- Gemma: spaces become ``▁`` (normalizer), no prefix space; Llama/Phi-3 SentencePiece: a ``▁`` is
  prepended to the text and to each stretch of it after a special token, as sentencepiece's
  ``add_dummy_prefix`` and llama.cpp do, unless ``tokenizer.ggml.add_space_prefix`` is false.
- Byte-level vocabularies keep their merges and get the pre-tokenizer split their ``tokenizer.ggml.pre``
  names (llama-3, qwen2 styles).
- A special id (BOS, EOS, unknown, padding) outside the vocabulary is refused.
- Control tokens become special added tokens (never split, dropped when decoding with
  ``skip_special_tokens``); user-defined ones plain added tokens, matched whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelError
from .gguf_file import MAX_CONTEXT, GgufFile, show

CONTROL, USER_DEFINED = 3, 4
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLITS = {"llama3": _WORDS + r"\p{N}{1,3}" + _REST, "qwen2": _WORDS + r"\p{N}" + _REST}
_SPLITS["llama-bpe"] = _SPLITS["llama-v3"] = _SPLITS["llama3"]


def _sentencepiece_merges(tokens: list[str], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary tokens, best merged token first.

    A cut is only tried where both sides have the length of some token, so a long token costs its length
    in cuts and a slice only per cut that can match: linear in the vocabulary's size, never quadratic in
    one token's length."""
    vocab = {t: i for i, t in enumerate(tokens)}
    lengths = {len(t) for t in tokens}
    found: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score in priority.items():
        n = len(piece)
        for cut in range(1, n):
            if cut not in lengths or n - cut not in lengths:
                continue
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -len(left), -len(right), vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_tokenizer(f: GgufFile, arch: str) -> tuple[Any, dict]:
    """The ``tokenizers.Tokenizer`` and the ``tokenizer_config.json`` fields of ``f``'s vocabulary."""
    if not f.has("tokenizer.ggml.tokens"):
        raise ModelError(f"{f.path}: no tokenizer in the file (metadata tokenizer.ggml.tokens is missing)")
    kind = f.get("tokenizer.ggml.model")
    tokens = f.strings("tokenizer.ggml.tokens")
    types = _token_types(f, len(tokens))
    _check_special_ids(f, len(tokens))
    gemma = arch.startswith("gemma")
    if kind == "llama":
        if gemma:
            tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
        tok = _sentencepiece_tokenizer(f, tokens, gemma)
    elif kind == "gpt2":
        tok = _byte_level_tokenizer(f, tokens)
    else:
        raise ModelError(f"{f.path}: tokenizer model {show(kind)} is not supported (supported: llama, gpt2)")
    _add_listed_tokens(tok, tokens, types)
    config = _set_post_processor(f, tok, tokens, add_bos_default=kind == "llama")
    config.update(
        {
            "unk_token": _special(f, tokens, "unknown_token_id"),
            "pad_token": _special(f, tokens, "padding_token_id"),
            "model_max_length": f.integer(f"{arch}.context_length", 4096, hi=MAX_CONTEXT),
            "tokenizer_class": "GemmaTokenizer" if gemma else "PreTrainedTokenizerFast",
        }
    )
    template = f.get("tokenizer.chat_template", None)
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return tok, config


def _token_types(f: GgufFile, n_tokens: int) -> list[int]:
    """Each token's type (1 normal … 6 byte); all normal when the file lists none."""
    if f.has("tokenizer.ggml.token_type"):
        return [int(t) for t in f.numbers("tokenizer.ggml.token_type", n_tokens, "iu")]
    return [1] * n_tokens


def _check_special_ids(f: GgufFile, n_tokens: int) -> None:
    """Refuse a BOS, EOS, unknown or padding id that is not an id of the vocabulary."""
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = f.get(f"tokenizer.ggml.{key}", None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_tokens):
            raise ModelError(
                f"{f.path}: tokenizer.ggml.{key} is {show(value)}, outside the vocabulary of {n_tokens:,} tokens "
                f"(an id in 0..{n_tokens - 1:,})"
            )


def _special(f: GgufFile, tokens: list[str], key: str) -> str | None:
    """The token that ``tokenizer.ggml.<key>`` names, or None when the file names none."""
    value = f.get(f"tokenizer.ggml.{key}", None)
    return tokens[int(value)] if value is not None else None


def _sentencepiece_tokenizer(f: GgufFile, tokens: list[str], gemma: bool) -> Any:
    """A SentencePiece BPE (byte fallback) with merges recovered from the vocabulary; Gemma's or Llama's
    handling of spaces."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if gemma:
        priority: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = [float(s) for s in f.numbers("tokenizer.ggml.scores", len(tokens))]
        priority = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError(f"{f.path}: the vocabulary repeats tokens ({len(tokens) - len(vocab)} duplicates)")
    unk = _special(f, tokens, "unknown_token_id")
    tok = Tokenizer(
        BPE(vocab, _sentencepiece_merges(tokens, priority), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok
    # sentencepiece's add_dummy_prefix: a "▁" before the text even when it starts with a space, and
    # (as llama.cpp does) before each stretch of text after a special token. Metaspace's "first"
    # scheme would skip both.
    prefix = f.flag("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def _byte_level_tokenizer(f: GgufFile, tokens: list[str]) -> Any:
    """A byte-level BPE with the file's merges and the pre-tokenizer split ``tokenizer.ggml.pre`` names."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if not f.has("tokenizer.ggml.merges"):
        raise ModelError(f"{f.path}: a byte-level (gpt2) vocabulary without tokenizer.ggml.merges")
    merges = [(a, b) for a, _, b in (m.partition(" ") for m in f.strings("tokenizer.ggml.merges"))]
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        tok = Tokenizer(BPE(vocab, merges, ignore_merges=False))
    except Exception as exc:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise ModelError(f"{f.path}: tokenizer.ggml.merges do not fit the vocabulary ({exc})") from exc
    split = _SPLITS.get(str(f.get("tokenizer.ggml.pre", "")), _SPLITS["llama3"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_listed_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (both matched whole)."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED])


def _set_post_processor(f: GgufFile, tok: Any, tokens: list[str], add_bos_default: bool) -> dict:
    """The template adding BOS/EOS as the file asks; returns those tokenizer_config.json fields."""
    from tokenizers import processors

    bos = _special(f, tokens, "bos_token_id")
    add_bos = f.flag("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = f.flag("tokenizer.ggml.add_eos_token", False)
    eos = _special(f, tokens, "eos_token_id")
    single, pair = "$A:0", "$A:0 $B:1"
    specials = []
    if add_bos and bos is not None:
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        specials.append((bos, tokens.index(bos)))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        specials.append((eos, tokens.index(eos)))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return {"add_bos_token": add_bos, "add_eos_token": add_eos, "bos_token": bos, "eos_token": eos}


def write_tokenizer(f: GgufFile, arch: str, folder: Path) -> dict:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``; returns the config."""
    tok, config = build_tokenizer(f, arch)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return config
