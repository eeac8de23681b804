"""bench grammar's correctness check, on a tiny tokenizer trained here and llguidance only: a walk accepts every
token of schema-valid documents (validated by jsonschema, the reference), and masks leave out tokens that
break the schema."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
tokenizers = pytest.importorskip("tokenizers")

from edge_agent.bench import grammar_docs as gd  # noqa: E402
from edge_agent.bench import grammar_engines as ge  # noqa: E402
from edge_agent.bench.grammar_walk import allocate, allowed, apply_mask, walk  # noqa: E402
from edge_agent.bench.vocab32k import PHI3_ADDED, continuation_ids, token_bytes, train  # noqa: E402

N_LOGITS = 640


@pytest.fixture(scope="module")
def tiny():
    rng = random.Random(7)
    lines = [json.dumps(gd.tool_call_doc(rng)) for _ in range(200)]
    lines += [json.dumps(gd.json_object_doc(rng)) for _ in range(200)]
    text = train(lines, vocab_size=600)
    tok = tokenizers.Tokenizer.from_str(text)
    spec = ge.TokenizerSpec(text, N_LOGITS, tok.token_to_id("<|end|>"))
    engine = ge.load("llguidance", spec, threads=2)
    assert isinstance(engine, ge.Loaded)
    return tok, spec, engine.engine


def byte_token(tok, ch: str) -> int:
    return tok.token_to_id(f"<0x{ord(ch):02X}>")


def test_tiny_tokenizer_has_the_llama_phi3_layout(tiny):
    tok, spec, _ = tiny
    assert [tok.id_to_token(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert tok.token_to_id("<0xFF>") == 258
    assert [tok.token_to_id(t) for t in PHI3_ADDED] == list(range(600, 600 + len(PHI3_ADDED)))
    assert token_bytes(spec.json_text)[tok.token_to_id("<0x0A>")] == b"\n"


@pytest.mark.parametrize("grammar", sorted(gd.SCHEMAS))
def test_walk_allows_every_token_of_valid_documents(tiny, grammar):
    tok, spec, engine = tiny
    docs = [gd.documents(grammar, tok, 120, seed) for seed in range(2)]
    for ids in docs[0] + docs[1]:
        jsonschema.validate(json.loads(tok.decode(ids)), gd.SCHEMAS[grammar])  # the documents are valid
    compiled = engine.compile(gd.SCHEMAS[grammar])
    one = walk(engine, compiled, docs[:1], N_LOGITS, spec.eos, label=grammar)
    # every token of every document, then EOS once each document is complete: all allowed, all timed
    assert len(one.mask_us) == sum(len(d) + 1 for d in docs[0])
    assert one.documents == len(docs[0])
    two = walk(engine, compiled, docs, N_LOGITS, spec.eos, label=grammar)
    assert len(two.mask_us) == min(sum(len(d) + 1 for d in row) for row in docs)


def test_walk_fails_on_a_document_the_schema_refuses(tiny):
    tok, spec, engine = tiny
    compiled = engine.compile(gd.TOOL_CALL_SCHEMA)
    doc = gd.tool_call_doc(random.Random(1))
    doc["name"] = "format_disk"  # not one of the three tools
    with pytest.raises(ge.TokenRejected, match="leaves out token"):
        walk(engine, compiled, [[continuation_ids(tok, json.dumps(doc))]], N_LOGITS, spec.eos, label="bad")


def _mask_after(engine, compiled, tok, prefix: str) -> np.ndarray:
    m = engine.matcher(compiled)
    for t in continuation_ids(tok, prefix):
        engine.consume(m, t)
    mask = allocate(1, N_LOGITS)
    engine.fill([m], mask)
    return mask


def test_masks_leave_out_tokens_that_break_the_schema(tiny):
    tok, spec, engine = tiny
    compiled = engine.compile(gd.TOOL_CALL_SCHEMA)
    start = allocate(1, N_LOGITS)
    engine.fill([engine.matcher(compiled)], start)
    assert allowed(start, 0, byte_token(tok, "{"))
    assert not allowed(start, 0, byte_token(tok, "["))  # not an object
    assert not allowed(start, 0, spec.eos)

    name = _mask_after(engine, compiled, tok, '{"name": "')
    assert allowed(name, 0, byte_token(tok, "s")) and allowed(name, 0, byte_token(tok, "g"))
    assert not allowed(name, 0, byte_token(tok, "z"))  # no tool starts with z

    head = '{"name": "search_web", "arguments": {"query": "'
    below = _mask_after(engine, compiled, tok, head + "a" * 63)
    at_limit = _mask_after(engine, compiled, tok, head + "a" * 64)  # maxLength 64
    assert allowed(below, 0, byte_token(tok, "a"))
    assert not allowed(at_limit, 0, byte_token(tok, "a"))
    assert allowed(at_limit, 0, byte_token(tok, '"'))

    flag = _mask_after(engine, compiled, tok, head + 'x", "limit": 3, "exact": ')
    assert allowed(flag, 0, byte_token(tok, "t")) and allowed(flag, 0, byte_token(tok, "f"))
    assert not allowed(flag, 0, byte_token(tok, '"')) and not allowed(flag, 0, byte_token(tok, "1"))


def test_apply_mask_matches_llguidance_reference(tiny):
    from llguidance.numpy import apply_token_bitmask_inplace

    tok, spec, engine = tiny
    compiled = engine.compile(gd.TOOL_CALL_SCHEMA)
    mask = _mask_after(engine, compiled, tok, '{"name": "')
    logits = np.random.default_rng(0).standard_normal((1, N_LOGITS), dtype=np.float32)
    ours, ref = logits.copy(), logits.copy()
    apply_mask(ours, mask)
    apply_token_bitmask_inplace(ref, mask)
    np.testing.assert_array_equal(ours, ref)
    assert np.isinf(ours).sum() > N_LOGITS // 2  # most tokens cannot follow {"name": "


def _decoded_bytes_agree(tok, table: dict[int, bytes], prefix_id: int, prefix: str) -> int:
    checked = 0
    for i, raw in table.items():
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial UTF-8 sequence: the decoder shows U+FFFD, nothing to compare
        # after a plain prefix token, so a decoder that strips the first space does not touch this one
        assert tok.decode([prefix_id, i]) == prefix + text, (i, tok.id_to_token(i))
        checked += 1
    return checked


def test_token_bytes_match_the_tokenizers_own_decoder(tiny):
    tok, spec, _ = tiny
    table = token_bytes(spec.json_text)
    # every model token but the 128 bytes 0x80-0xFF, which alone are partial UTF-8 (the corpus is ASCII)
    assert _decoded_bytes_agree(tok, table, tok.token_to_id("a"), "a") == len(table) - 128


def test_token_bytes_of_a_byte_level_vocabulary():
    from edge_agent.models.catalog import DEMO_DIR

    path = DEMO_DIR / "demo-whisper" / "tokenizer.json"
    text = path.read_text(encoding="utf-8")
    tok = tokenizers.Tokenizer.from_str(text)
    table = token_bytes(text)
    assert _decoded_bytes_agree(tok, table, tok.token_to_id("a"), "a") > 200
