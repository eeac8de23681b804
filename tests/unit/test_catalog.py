from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edge_agent.errors import InputError, ModelError, ModelNotFound
from edge_agent.models.catalog import DEMO_DIR, inspect_folder, resolve_model
from edge_agent.models.llm import DecoderLM


def copy_demo(tmp_path, name="demo-phi3"):
    folder = tmp_path / name
    shutil.copytree(DEMO_DIR / name, folder)
    return folder


def test_demo_names_resolve_to_their_kind(tmp_path):
    assert resolve_model("demo-phi3", tmp_path).kind == "llm"
    assert resolve_model("demo-gemma2", tmp_path).model_type == "gemma2"


def test_unknown_name_and_file_paths(tmp_path):
    with pytest.raises(ModelNotFound, match="not a demo model"):
        resolve_model("demo-llama", tmp_path)
    folder = copy_demo(tmp_path)
    with pytest.raises(ModelError, match="give the model folder"):
        resolve_model(folder / "model.onnx", tmp_path)
    assert resolve_model(folder, tmp_path).path == folder.resolve()


@pytest.mark.parametrize(
    "missing, message",
    [
        ("config.json", "no config.json"),
        ("model.onnx", "missing model.onnx"),
        ("tokenizer.json", "missing tokenizer.json"),
    ],
)
def test_incomplete_export_names_the_missing_file(tmp_path, missing, message):
    folder = copy_demo(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(ModelError, match=message):
        inspect_folder(folder)


def test_corrupt_config_json_names_the_line(tmp_path):
    folder = copy_demo(tmp_path)
    (folder / "config.json").write_text('{"model_type": "phi3",\n oops}')
    with pytest.raises(ModelError, match=r"config.json: not valid JSON \(line 2"):
        inspect_folder(folder)


def test_prompt_checks(tmp_path):
    lm = DecoderLM.open(resolve_model("demo-phi3", tmp_path))
    try:
        with pytest.raises(InputError, match="empty"):
            list(lm.generate_greedy([], 4))
        with pytest.raises(InputError, match="max_new_tokens must be at least 1"):
            list(lm.generate_greedy([5], 0))
        ctx = lm.contract.max_context
        with pytest.raises(InputError, match=f"exceeds the model's context of {ctx}"):
            list(lm.generate_greedy([5] * ctx, 1))
    finally:
        lm.close()


def test_export_without_kv_cache_is_refused_with_the_fix(tmp_path):
    from tests.onnx_models import affine_relu

    folder = tmp_path / "nokv"
    folder.mkdir()
    affine_relu(folder / "model.onnx")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "demo-phi3" / f, folder / f)
    with pytest.raises(ModelError, match="input_ids"):
        DecoderLM.open(inspect_folder(folder))


GENAI = Path(__file__).resolve().parent.parent / "data" / "demo-phi3-genai"


@pytest.mark.parametrize("form", ["plain", "genai"])
def test_decoder_parses_its_tokenizer_before_loading_weights(form, tmp_path, monkeypatch):
    # Parsing a large tokenizer.json (Gemma 3's: ~270 MB above what it keeps) before the weights are in
    # memory keeps that burst from setting the process's peak. An in-place KV graph runs without ONNX
    # Runtime's arena (what a long prompt's buffers took goes back); a plain one, allocating its growing
    # cache every step, keeps it.
    import edge_agent.models.llm as llm

    order: list[str] = []
    real_tokenizer, real_session = llm.open_tokenizer, llm.open_session
    monkeypatch.setattr(llm, "open_tokenizer", lambda ref: (order.append("tokenizer"), real_tokenizer(ref))[1])
    monkeypatch.setattr(llm, "open_session", lambda *a, **k: (order.append("weights"), real_session(*a, **k))[1])
    ref = inspect_folder(GENAI) if form == "genai" else resolve_model("demo-phi3", tmp_path)
    lm = DecoderLM.open(ref)
    try:
        assert order == ["tokenizer", "weights"]
        assert lm.session._session.get_session_options().enable_cpu_mem_arena is (form == "plain")
        assert len(list(lm.generate_greedy(lm.tokenizer.encode("hello"), 3, stop_at_eos=False))) == 3
    finally:
        lm.session.close()
