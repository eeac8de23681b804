from __future__ import annotations

import json
import shutil

import pytest

from edge_agent.errors import InputError, ModelError
from edge_agent.models.catalog import DEMO_DIR
from edge_agent.models.tokenizer import FALLBACK_TEMPLATES, Message, StreamDecoder, Tokenizer

CHAT = [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "Time?")]


@pytest.mark.parametrize(
    "name, model_type, expected",
    [
        # The prompt formats published with Phi-3-mini and Gemma.
        ("demo-phi3", "phi3", "<|user|>\nHello<|end|>\n<|assistant|>\n"),
        ("demo-gemma", "gemma", "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"),
        ("demo-gemma2", "gemma2", "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"),
    ],
)
def test_models_own_chat_template_renders_the_published_format(name, model_type, expected):
    tok = Tokenizer(DEMO_DIR / name, model_type)
    assert tok.render_chat([Message("user", "Hello")]) == expected
    ids = tok.encode_chat([Message("user", "Hello")])
    assert tok.decode(ids, skip_special_tokens=False) == expected  # special tokens are single tokens
    first = "<|user|>" if model_type == "phi3" else "<bos>"
    assert ids[0] == tok.token_id(first)


@pytest.mark.parametrize("name, model_type", [("demo-phi3", "phi3"), ("demo-gemma", "gemma")])
def test_fallback_template_matches_the_models_own(name, model_type, tmp_path):
    own = Tokenizer(DEMO_DIR / name, model_type)
    folder = tmp_path / name
    shutil.copytree(DEMO_DIR / name, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    fallback = Tokenizer(folder, model_type)
    assert fallback.chat_template == FALLBACK_TEMPLATES[model_type]
    chat = CHAT[1:] if model_type == "gemma" else CHAT  # Gemma's template refuses a system role
    assert fallback.render_chat(chat) == own.render_chat(chat)


def test_gemma_template_refuses_system_role_with_a_clear_error():
    tok = Tokenizer(DEMO_DIR / "demo-gemma", "gemma")
    with pytest.raises(InputError, match="chat template refused"):
        tok.render_chat(CHAT)


def test_bad_messages():
    tok = Tokenizer(DEMO_DIR / "demo-phi3", "phi3")
    with pytest.raises(InputError, match="at least one message"):
        tok.render_chat([])
    with pytest.raises(InputError, match=r"messages\[0\].role: 'robot'"):
        tok.render_chat([Message("robot", "x")])


def test_stream_decoder_pieces_add_up_to_the_full_text():
    tok = Tokenizer(DEMO_DIR / "demo-phi3", "phi3")
    text = "Set the kitchen light to 40% — café, naïve, 日本語."
    ids = tok.encode(text, add_special_tokens=False)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == stream.text
    assert not any("\ufffd" in p for p in pieces)  # split multi-byte characters are held back


def test_missing_or_corrupt_tokenizer(tmp_path):
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelError, match="unreadable tokenizer"):
        Tokenizer(tmp_path)
