"""models import of a CTranslate2 Whisper folder: a tiny random Whisper written in CTranslate2's format
(float32, float16, int8), imported, and its ONNX graphs checked against Whisper in numpy on the same
(dequantized) weights; the recogniser serves the folder on ONNX Runtime and OpenVINO (CPU) with the
greedy ids of the numpy model; bad files are refused and leave nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import ModelError
from edge_agent.importers import detect_format, import_model
from tests import ct2_whisper_tiny as tiny

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def _session(path: Path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=["float32", "float16", "int8"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"ct2-{request.param}")
    eff = tiny.write_folder(root / "src", request.param)
    result = import_model(root / "src", None, root / "cache")
    return result, eff


def test_import_writes_the_whisper_contract(imported):
    result, _ = imported
    assert result.source_format == "ctranslate2-whisper" and result.architecture == "whisper"
    assert result.path == result.path.parent.parent / "imported" / result.name
    names = {p.name for p in result.path.iterdir()}
    assert {
        "encoder_model.onnx",
        "decoder_model.onnx",
        "decoder_with_past_model.onnx",
        "tokenizer.json",
        "preprocessor_config.json",
        "config.json",
        "generation_config.json",
        "import.json",
    } <= names
    gen = json.loads((result.path / "generation_config.json").read_text())
    demo = json.loads((tiny.DEMO_WHISPER / "generation_config.json").read_text())
    # token ids read from the tokenizer agree with the ones transformers wrote for the same tokenizer
    for key in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id", "lang_to_id", "task_to_id"):
        assert gen[key] == demo[key], key
    assert gen["suppress_tokens"] == demo["suppress_tokens"]
    record = json.loads((result.path / "import.json").read_text())
    assert record["source"]["spec"] == "WhisperSpec"


def test_encoder_and_decoders_match_numpy_whisper(imported):
    result, w = imported
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((1, tiny.MELS, 3000)).astype(np.float32) * 0.5
    hidden = _session(result.path / "encoder_model.onnx").run(None, {"input_features": feats})[0]
    want = tiny.encode(w, feats[0])
    assert hidden.shape == (1, tiny.SRC, tiny.D)
    np.testing.assert_allclose(hidden[0], want, atol=2e-4, rtol=0)

    ids = [513, 514, 523, 527, 40, 41, 300, 7]
    ref = tiny.decode_logits(w, want, ids)
    dec = _session(result.path / "decoder_model.onnx")
    names = [o.name for o in dec.get_outputs()]
    out = dict(zip(names, dec.run(None, {"input_ids": np.array([ids[:4]], np.int64), "encoder_hidden_states": hidden})))
    np.testing.assert_allclose(out["logits"][0], ref[:4], atol=2e-4, rtol=0)
    # then one token at a time with the cache: each step's logits are the full pass's row
    past = {k.replace("present.", "past_key_values."): v for k, v in out.items() if k != "logits"}
    step = _session(result.path / "decoder_with_past_model.onnx")
    step_names = [o.name for o in step.get_outputs()]
    for t in range(4, len(ids)):
        res = dict(zip(step_names, step.run(None, {"input_ids": np.array([[ids[t]]], np.int64), **past})))
        np.testing.assert_allclose(res["logits"][0, 0], ref[t], atol=2e-4, rtol=0)
        for k, v in res.items():
            if k != "logits":
                past[k.replace("present.", "past_key_values.")] = v
        assert past["past_key_values.0.decoder.key"].shape[2] == t + 1


def test_decoders_give_only_the_last_positions_logits_when_asked(imported):
    # a decode reads the logits after its prompt only: the context before needs no vocabulary product
    result, w = imported
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((2, tiny.SRC, tiny.D)).astype(np.float32)
    ids = [[513, 514, 523, 527, 40, 41, 300, 7], [513, 40, 41, 300, 514, 523, 527, 9]]
    refs = [tiny.decode_logits(w, hidden[b], row) for b, row in enumerate(ids)]
    dec = _session(result.path / "decoder_model.onnx")
    assert "logits_to_keep" in {i.name for i in dec.get_overridable_initializers()}
    names = [o.name for o in dec.get_outputs()]
    for keep, rows in ((0, 8), (1, 1), (3, 3), (8, 8), (20, 8)):  # 0: every position; more than there are: all
        feeds = {"input_ids": np.array(ids, np.int64), "encoder_hidden_states": hidden}
        out = dict(zip(names, dec.run(None, {**feeds, "logits_to_keep": np.array(keep, np.int64)})))
        assert out["logits"].shape == (2, rows, tiny.VOCAB)
        for b in range(2):
            np.testing.assert_allclose(out["logits"][b], refs[b][8 - rows :], atol=2e-4, rtol=0)
    # the cached decoder: three new tokens after a cache of five, the last two positions' logits
    first = dict(
        zip(
            names,
            dec.run(None, {"input_ids": np.array([r[:5] for r in ids], np.int64), "encoder_hidden_states": hidden}),
        )
    )
    past = {k.replace("present.", "past_key_values."): v for k, v in first.items() if k != "logits"}
    step = _session(result.path / "decoder_with_past_model.onnx")
    step_names = [o.name for o in step.get_outputs()]
    feeds = {"input_ids": np.array([r[5:] for r in ids], np.int64), **past, "logits_to_keep": np.array(2, np.int64)}
    res = dict(zip(step_names, step.run(None, feeds)))
    for b in range(2):
        np.testing.assert_allclose(res["logits"][b], refs[b][6:], atol=2e-4, rtol=0)


def test_encoder_takes_a_shorter_context_as_numpy_whisper_does(imported):
    """Partials encode a few seconds (the first F / 2 positions); 3000 frames stay the full pass above."""
    result, w = imported
    feats = np.random.default_rng(3).standard_normal((2, tiny.MELS, 400)).astype(np.float32) * 0.5
    hidden = _session(result.path / "encoder_model.onnx").run(None, {"input_features": feats})[0]
    assert hidden.shape == (2, 200, tiny.D)
    for row in range(2):
        np.testing.assert_allclose(hidden[row], tiny.encode(w, feats[row]), atol=2e-4, rtol=0)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_recogniser_serves_the_imported_folder(imported, backend):
    from edge_agent.models.asr import open_recognizer
    from edge_agent.models.catalog import resolve_model

    if backend == "openvino":
        pytest.importorskip("openvino")
    result, w = imported
    cache = result.path.parent.parent
    ref = resolve_model(result.name, cache)  # addressable by its folder name under <cache>/imported
    assert ref.kind == "asr-whisper"
    rec = open_recognizer(ref, backend, language="en")
    x = np.random.default_rng(2).standard_normal(16000).astype(np.float32) * 0.05
    hyp = rec.transcribe(x)
    # greedy from numpy: the recogniser's ids are the argmax of the reference logits at each step,
    # under the same suppression (specials, timestamps, suppress_tokens, begin_suppress at the start)
    from edge_agent.models.whisper_features import log_mel_spectrogram

    hidden = tiny.encode(w, log_mel_spectrogram(x, rec.features))
    prompt = rec.prompt("en")
    ids: list[int] = []
    for _ in hyp.token_ids:
        logits = tiny.decode_logits(w, hidden, prompt + ids)[-1]
        mask = rec._begin_mask if not ids else rec._suppress_mask
        ids.append(int(np.argmax(np.where(mask, -np.inf, logits))))
    assert list(hyp.token_ids) == ids

    # a partial encodes the audio and 6 s of padding, a final all 30 s: each greedy on its own encoding
    assert rec.short_context
    assert rec.context_frames(x.size, final=False) == 700 and rec.context_frames(x.size, final=True) == 3000
    stream = rec.new_stream()
    stream.add_audio(x)
    partial = rec.step([stream])[0]
    assert partial is not None and not partial.final
    assert stream.hidden is None  # its window is not the final's: nothing a final could reuse
    short = tiny.encode(w, log_mel_spectrogram(x, rec.features)[:, :700])
    ids = []
    for _ in partial.token_ids:
        logits = tiny.decode_logits(w, short, prompt + ids)[-1]
        ids.append(int(np.argmax(np.where(rec._begin_mask if not ids else rec._suppress_mask, -np.inf, logits))))
    assert list(partial.token_ids) == ids
    stream.end()
    final = rec.step([stream])[0]  # no new audio, yet a 30 s pass: the partial's context was short
    assert final is not None and final.final and final.token_ids == rec.transcribe(x).token_ids
    rec.close()


def test_importing_the_same_folder_again_writes_the_same_folder(imported, tmp_path, monkeypatch):
    """The folder's hash keys its engines: importing the same source again changes none of its bytes, however
    long it took."""
    import itertools

    import edge_agent.importers.ct2_whisper as ct2_importer
    from edge_agent.engines.cache import hash_model

    ticks = itertools.count(1000.0, 7.5)  # a slow import: every clock reading 7.5 s after the last
    monkeypatch.setattr(ct2_importer.time, "monotonic", lambda: next(ticks))
    result, _ = imported
    again = import_model(result.path.parents[2] / "src", None, tmp_path / "cache")  # into another cache
    assert hash_model(again.path) == hash_model(result.path)


def test_truncated_or_foreign_model_bin_is_refused_and_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    tiny.write_folder(src, "float16")
    data = (src / "model.bin").read_bytes()
    (src / "model.bin").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out" / "whisper"
    with pytest.raises(ModelError, match="truncated"):
        import_model(src, out, tmp_path / "cache")
    assert not out.exists() and not list(out.parent.glob(".whisper.importing-*"))

    variables, _ = tiny.stored(tiny.random_weights(), "float16")
    tiny.write_model_bin(src / "model.bin", variables, {}, spec="TransformerSpec")
    with pytest.raises(ModelError, match="not a WhisperSpec"):
        import_model(src, out, tmp_path / "cache")
    assert detect_format(src) == "ctranslate2-whisper"
