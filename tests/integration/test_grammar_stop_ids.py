"""A constrained output may end with any of the model's stop ids where its format may end: llguidance
knows one end token (the smallest stop id), but Gemma's turns end with <end_of_turn> beside <eos>
(demo-gemma's stop ids are 1 and 5). Where the format may not end yet, neither is allowed."""

from __future__ import annotations

import json

import numpy as np

from tests.conftest import REPO


def test_every_stop_id_ends_a_text_reply_and_none_ends_an_unfinished_call():
    from edge_agent.backends import SessionOptions
    from edge_agent.models.catalog import resolve_model
    from edge_agent.models.grammar import tool_or_text_grammar
    from edge_agent.models.llm import DecoderLM

    tools = json.loads((REPO / "edge_agent" / "demo_models" / "home-tools.json").read_text())["tools"]
    lm = DecoderLM.open(resolve_model("demo-gemma", REPO), "onnxruntime", SessionOptions(threads=1))
    try:
        stops = sorted(lm.contract.eos_ids)
        assert len(stops) >= 2  # the point of the test
        vocab = lm.token_vocab
        text = vocab.constraint(tool_or_text_grammar(tools))
        word = lm.tokenizer.encode("Sorry", add_special_tokens=False)
        for token in word:
            assert text.allowed()[token]
            text.consume(token)
        mask = text.allowed()
        assert all(mask[s] for s in stops)  # words may end here, with any stop id
        call = vocab.constraint(tool_or_text_grammar(tools))
        brace = lm.tokenizer.encode('{"', add_special_tokens=False)
        for token in brace:
            if call.allowed()[token]:
                call.consume(token)
        mask = call.allowed()
        assert not any(mask[s] for s in stops) and np.any(mask)  # a call begun must be finished first
    finally:
        lm.close()


def test_models_of_one_tokenizer_share_one_token_table_and_others_build_their_own():
    """The ladder's rungs of one model load the same tokenizer: the table (seconds for a 262k vocabulary) is
    built once; a model with another tokenizer gets its own, whose mask is its own vocabulary's width."""
    from edge_agent.backends import SessionOptions
    from edge_agent.models.catalog import resolve_model
    from edge_agent.models.llm import DecoderLM

    opened = [
        DecoderLM.open(resolve_model(name, REPO), "onnxruntime", SessionOptions(threads=1))
        for name in ("demo-gemma", "demo-gemma", "demo-phi3")
    ]
    try:
        a, b, other = (lm.token_vocab for lm in opened)
        assert a is b and other is not a
        assert a.n_logits != other.n_logits or opened[0].tokenizer.to_json() != opened[2].tokenizer.to_json()
    finally:
        for lm in opened:
            lm.close()
