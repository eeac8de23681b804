"""The incremental detokenizer against the tokenizers library decoding every id at once."""

from __future__ import annotations

import random

import pytest

from edge_agent.models.catalog import resolve_model
from edge_agent.models.tokenizer import StreamDecoder, Tokenizer

TEXTS = ["Hello world, ünïcödé ✓ — 東京 is big.\n  indented", "def f(x):\n    return x * 2  # ok 🙂"]


@pytest.fixture(scope="module", params=["demo-phi3", "demo-gemma", "demo-whisper"])
def tok(request, tmp_path_factory):
    ref = resolve_model(request.param, tmp_path_factory.mktemp("m"))
    return Tokenizer(ref.path, ref.model_type)


def test_pieces_add_up_to_the_full_decode_for_any_ids(tok):
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.id_limit) for _ in range(rng.randrange(1, 48))]
        decoder = StreamDecoder(tok)
        pieces = [decoder.push(i) for i in ids]
        full = tok.decode(ids)
        assert decoder.text == full
        assert full.startswith("".join(pieces))  # only a held-back incomplete character may be missing
        assert not any(p.endswith("\ufffd") for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_streams_back_exactly_and_never_splits_a_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == decoder.text == tok.decode(ids)
