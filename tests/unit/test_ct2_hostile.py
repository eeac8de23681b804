"""The CTranslate2 Whisper importer on folders a buggy converter or a hostile user could hand it: a
``tokenizer.json`` that is not one, a ``config.json`` that is not an object, token id lists that are not
lists of ids or name ids past the model's rows, special tokens past the embedding table, a ``model.bin``
declaring billions of variables. Each is one ``ModelError`` naming the file and the key, and nothing is
written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from edge_agent.errors import ModelError
from edge_agent.importers import import_model
from tests import ct2_whisper_tiny as tiny

pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("ct2") / "src"
    tiny.write_folder(src, "float16")
    return src


def _copy(good: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in good.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _refused(src: Path, tmp_path: Path, *needles: str) -> str:
    out = tmp_path / "out"
    with pytest.raises(ModelError) as err:
        import_model(src, out / "whisper", tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    for needle in needles:
        assert needle in message, message
    assert not out.exists() or list(out.iterdir()) == []
    return message


@pytest.mark.parametrize(
    ("text", "said"),
    [("not json at all", "not a tokenizer.json the tokenizers library reads"), ("{}", "not a tokenizer.json")],
)
def test_a_tokenizer_that_is_not_one_names_the_file(good, tmp_path, text, said):
    src = _copy(good, tmp_path / "src")
    (src / "tokenizer.json").write_text(text)
    _refused(src, tmp_path, str(src / "tokenizer.json"), said)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ([1, 2, 3], "a JSON list, not an object"),
        ("[" * 100_000 + "]" * 100_000, "not readable JSON"),
        ({"lang_ids": "50259"}, "lang_ids is '50259'; it must be a list of token ids"),
        ({"suppress_ids": "1,2"}, "suppress_ids is '1,2'; it must be a list of token ids"),
        ({"suppress_ids_begin": [1.5]}, "suppress_ids_begin is [1.5]"),
        ({"lang_ids": [10**30]}, "lang_ids holds 1000000000000000000000000000000, outside the model's 2,029 tokens"),
        ({"suppress_ids": [-1]}, "suppress_ids holds -1"),
    ],
)
def test_config_json_of_the_wrong_kind_names_the_file_and_the_key(good, tmp_path, config, said):
    src = _copy(good, tmp_path / "src")
    (src / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    _refused(src, tmp_path, str(src / "config.json"), said)


def test_a_special_token_past_the_embedding_rows_is_refused(good, tmp_path):
    src = _copy(good, tmp_path / "src")
    tok = json.loads((src / "tokenizer.json").read_text())
    # the id of a vocabulary entry is what tokenizers keeps (an added token's own id is renumbered)
    tok["added_tokens"] = [a for a in tok["added_tokens"] if a["content"] != "<|endoftext|>"]
    tok["model"]["vocab"]["<|endoftext|>"] = 70_000
    (src / "tokenizer.json").write_text(json.dumps(tok))
    _refused(src, tmp_path, "<|endoftext|> is id 70,000, outside the model's 2,029 embedding rows")


def test_a_model_bin_declaring_billions_of_variables_is_refused(good, tmp_path):
    src = _copy(good, tmp_path / "src")
    name = b"WhisperSpec\0"
    (src / "model.bin").write_bytes(struct.pack("<IH", 6, len(name)) + name + struct.pack("<II", 1, 2**32 - 1))
    _refused(src, tmp_path, "4,294,967,295 variables")


def test_the_good_folder_still_imports(good, tmp_path):
    result = import_model(_copy(good, tmp_path / "src"), tmp_path / "out", tmp_path / "cache")
    assert (result.path / "decoder_model.onnx").is_file()
