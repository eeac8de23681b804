"""A LoRA adapter merged into an imported model (``importers.adapter.merge``) against an independent path.

The reference: the same tiny Gemma 3's weights with ``alpha / r · B @ A`` added in transformers' layout
([out, in]) *before* the GGUF is written, then imported as usual. The merged folder (the delta patched
into the imported weights in place, transposed) must give that import's logits; weights no adapter
touches stay byte for byte; a damaged adapter or another base is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from tests.gguf_files import TinyConfig, make_weights, spm_vocab, write_gguf

CFG = TinyConfig(
    "gemma3", layers=2, hidden=64, heads=4, kv_heads=1, head_dim=32, ffn=128, vocab=spm_vocab(), tied=True,
    rope_base=1_000_000.0, window=4, seed=3,
)  # fmt: skip
MODULES = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
RANK, ALPHA = 4, 8.0


def _adapter(tmp_path, base_sha: str):
    from edge_agent.importers.adapter import Adapter

    rng = np.random.default_rng(0)
    weights = make_weights(CFG)
    tensors = {}
    for i in range(CFG.layers):
        for m in MODULES:
            out, inp = weights[f"model.layers.{i}.{m}.weight"].shape
            tensors[f"model.layers.{i}.{m}.lora_A"] = rng.normal(0, 0.2, (RANK, inp)).astype(np.float16)
            tensors[f"model.layers.{i}.{m}.lora_B"] = rng.normal(0, 0.2, (out, RANK)).astype(np.float16)
    folder = tmp_path / "adapter"
    folder.mkdir()
    np.savez(folder / "adapter.npz", **tensors)
    sha = hashlib.sha256((folder / "adapter.npz").read_bytes()).hexdigest()
    meta = {"base": {"sha256": base_sha}, "rank": RANK, "alpha": ALPHA, "sha256": sha}
    (folder / "adapter.json").write_text(json.dumps(meta))
    return Adapter("tiny-home", "tiny", "test", folder), tensors


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from edge_agent.importers import import_model

    root = tmp_path_factory.mktemp("merge")
    src = write_gguf(root / "tiny.gguf", CFG, make_weights(CFG))
    return import_model(src, root / "base", root / "cache").path


def _run(folder, ids):
    from edge_agent.backends import SessionOptions, open_session

    session = open_session(folder / "model.onnx", "onnxruntime", SessionOptions(threads=1))
    feeds = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
    }
    for spec in session.inputs:
        if spec.name.startswith("past_key_values"):
            feeds[spec.name] = np.zeros((1, CFG.kv_heads, 0, CFG.head_dim), np.float32)
    return session.run(feeds)["logits"]


def test_a_merged_adapter_gives_the_logits_of_the_weights_changed_before_import(imported, tmp_path):
    from edge_agent.importers import import_model
    from edge_agent.importers.adapter import merge

    record = json.loads((imported / "import.json").read_text())
    adapter, tensors = _adapter(tmp_path, record["source"]["sha256"])
    merged = merge(adapter, imported, tmp_path / "merged").path

    changed = make_weights(CFG)
    for i in range(CFG.layers):
        for m in MODULES:
            a = tensors[f"model.layers.{i}.{m}.lora_A"].astype(np.float32)
            b = tensors[f"model.layers.{i}.{m}.lora_B"].astype(np.float32)
            changed[f"model.layers.{i}.{m}.weight"] = changed[f"model.layers.{i}.{m}.weight"] + ALPHA / RANK * (b @ a)
    reference = import_model(write_gguf(tmp_path / "changed.gguf", CFG, changed), tmp_path / "ref", tmp_path / "c")

    ids = [2, 17, 5, 40, 9, 33, 12, 7]
    got, want, before = _run(merged, ids), _run(reference.path, ids), _run(imported, ids)
    assert np.abs(got - before).max() > 0.1  # the adapter changes the model
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert json.loads((merged / "import.json").read_text())["adapter"]["sha256"] == adapter_sha(adapter)


def adapter_sha(adapter) -> str:
    return json.loads((adapter.folder / "adapter.json").read_text())["sha256"]


def test_weights_no_adapter_touches_stay_byte_for_byte(imported, tmp_path):
    import onnx
    from onnx import numpy_helper

    from edge_agent.importers.adapter import merge

    adapter, _ = _adapter(tmp_path, json.loads((imported / "import.json").read_text())["source"]["sha256"])
    merged = merge(adapter, imported, tmp_path / "merged").path
    base = {
        i.name: numpy_helper.to_array(i, str(imported))
        for i in onnx.load(str(imported / "model.onnx")).graph.initializer
    }
    after = {
        i.name: numpy_helper.to_array(i, str(merged)) for i in onnx.load(str(merged / "model.onnx")).graph.initializer
    }
    touched = {f"model.layers.{i}.{m}.weight" for i in range(CFG.layers) for m in MODULES}
    assert base.keys() == after.keys()
    for name in base.keys() - touched:
        assert base[name].tobytes() == after[name].tobytes(), name
    assert all(not np.array_equal(base[n], after[n]) for n in touched)


def test_a_damaged_adapter_or_another_base_is_refused_and_nothing_is_written(imported, tmp_path):
    from edge_agent.errors import ModelError
    from edge_agent.importers.adapter import merge

    sha = json.loads((imported / "import.json").read_text())["source"]["sha256"]
    adapter, _ = _adapter(tmp_path, "0" * 64)
    with pytest.raises(ModelError, match="not the model"):
        merge(adapter, imported, tmp_path / "other-base")
    assert not (tmp_path / "other-base").exists()
    meta = json.loads((adapter.folder / "adapter.json").read_text())
    (adapter.folder / "adapter.json").write_text(json.dumps({**meta, "base": {"sha256": sha}, "sha256": "1" * 64}))
    with pytest.raises(ModelError, match="damaged"):
        merge(adapter, imported, tmp_path / "damaged")
    assert not (tmp_path / "damaged").exists()
