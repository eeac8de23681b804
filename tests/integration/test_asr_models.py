"""The demo ASR models reproduce their PyTorch reference tokens on ONNX Runtime and OpenVINO."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, is_installed
from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from edge_agent.models.ctc_decode import greedy_ids

BACKENDS = [
    pytest.param("onnxruntime", id="ort"),
    pytest.param(
        "openvino", id="ov", marks=pytest.mark.skipif(not is_installed("openvino"), reason="openvino not installed")
    ),
]


def options(backend: str) -> SessionOptions:
    return SessionOptions(device="CPU" if backend == "openvino" else "cpu", threads=1)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    made = {}

    def get(name, backend, **kw):
        key = (name, backend, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = open_recognizer(resolve_model(name, cache), backend, options(backend), **kw)
        return made[key]

    yield get
    for e in made.values():
        e.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_demo_ctc_reproduces_the_pytorch_frame_argmax(engines, backend):
    engine = engines("demo-ctc", backend)
    ref = np.load(engine.ref.path / "reference.npz")
    logits = engine.frame_scores(ref["waveform"])  # our normalisation + the model
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4)
    np.testing.assert_array_equal(logits.argmax(-1), ref["greedy_ids"])
    hyp = engine.transcribe(ref["waveform"])
    assert hyp.token_ids == greedy_ids(ref["logits"], 0) and hyp.text == engine.vocab.text(hyp.token_ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_demo_whisper_reproduces_the_pytorch_greedy_tokens(engines, backend):
    engine = engines("demo-whisper", backend)
    ref = np.load(engine.ref.path / "reference.npz")
    hidden = engine.encode([ref["waveform"]])  # our numpy log-mel + the encoder
    np.testing.assert_allclose(hidden[0], ref["encoder_hidden_states"], atol=1e-4)
    # The reference is raw argmax for 16 steps from the 4-token prompt (no suppression, no stop).
    prompt = ref["decoder_prompt_ids"].tolist()
    assert prompt == engine.prompt("en")
    ids = engine.decode(hidden, [prompt], [[]], [16], suppress=False, stop_at_eot=False)[0]
    assert ids == ref["greedy_ids"].tolist()


def test_whisper_suppression_never_emits_specials_or_timestamps(engines):
    engine = engines("demo-whisper", "onnxruntime")
    ref = np.load(engine.ref.path / "reference.npz")
    hidden = engine.encode([ref["waveform"]])
    ids = engine.decode(hidden, [engine.prompt("en")], [[]], [40])[0]
    assert ids and all(i < engine.eot for i in ids)
    assert not any(engine._suppress_mask[i] for i in ids)
    assert ids[0] not in (220, engine.eot)  # begin_suppress_tokens


def test_whisper_forced_prefix_and_batched_lockstep_equal_single_rows(engines):
    engine = engines("demo-whisper", "onnxruntime")
    ref = np.load(engine.ref.path / "reference.npz")
    w = ref["waveform"]
    windows = [w, w[: len(w) // 2], w[::-1].copy()]
    hidden = engine.encode(windows)
    prompts = [engine.prompt("en"), engine.prompt("de"), engine.prompt("en")]
    single = [engine.decode(hidden[i : i + 1], [prompts[i]], [[]], [12])[0] for i in range(3)]
    forced = [single[0][:3], [], single[2][:1]]
    batched = engine.decode(hidden, prompts, forced, [12, 5, 12])
    assert batched[0] == single[0] and batched[2] == single[2] and batched[1] == single[1][:5]
    # a forced prefix that is not the model's choice is kept, and decoding continues after it
    other = engine.decode(hidden[:1], [prompts[0]], [[5, 6, 7]], [10])[0]
    assert other[:3] == [5, 6, 7] and len(other) >= 3


def test_whisper_language_detection_picks_a_known_language(engines):
    engine = engines("demo-whisper", "onnxruntime", language="auto")
    ref = np.load(engine.ref.path / "reference.npz")
    lang = engine.detect_language(engine.encode([ref["waveform"]]))[0]
    assert lang in engine.lang_to_id
    hyp = engine.transcribe(ref["waveform"])
    assert hyp.final and all(i < engine.eot for i in hyp.token_ids)
