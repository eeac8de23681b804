"""The stateful streaming-CTC path (docs/asr-models.md) on a tiny model built here with onnx.helper.

The model is a running sum, so streaming equivalence can be reasoned about exactly:

    cum[t]      = state_in.0 + features[0..t].sum()          (CumSum over time, plus the carry)
    log_probs   = LogSoftmax(cum[sub-1::sub] @ W)             (one output per ``subsampling`` frames)
    state_out.0 = state_in.0 + features.sum(over time)

Chunks with the state carried give the same ``log_probs`` as the whole utterance in one call,
which is exactly the contract a real streaming model (conv caches, GRU state) promises.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import inspect_folder
from edge_agent.serving.asr.batcher import BatchLimits
from edge_agent.serving.asr.service import AsrService
from tests.speech import speech_samples

MELS, VOCAB, SUB, CHUNK, FLUSH = 16, 8, 2, 8, 2
TOKENS = ["<pad>", "|", "A", "B", "C", "D", "E", "'"]


def build_running_sum_model(folder: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((MELS, VOCAB)) * 0.05).astype(np.float32)
    nodes = [
        helper.make_node("CumSum", ["features", "axis_scalar"], ["cum0"]),
        helper.make_node("Unsqueeze", ["state_in.0", "axis1"], ["carry"]),
        helper.make_node("Add", ["cum0", "carry"], ["cum"]),
        helper.make_node("Slice", ["cum", "start", "end", "axis1", "step"], ["sub"]),
        helper.make_node("MatMul", ["sub", "W"], ["logits"]),
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
        helper.make_node("ReduceSum", ["features", "axis1"], ["total"], keepdims=0),
        helper.make_node("Add", ["state_in.0", "total"], ["state_out.0"]),
    ]
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.array(1, np.int64), "axis_scalar"),  # CumSum takes a scalar axis
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([SUB - 1], np.int64), "start"),
        numpy_helper.from_array(np.array([2**62], np.int64), "end"),
        numpy_helper.from_array(np.array([SUB], np.int64), "step"),
    ]
    graph = helper.make_graph(
        nodes,
        "running_sum_ctc",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "frames", MELS]),
            helper.make_tensor_value_info("state_in.0", TensorProto.FLOAT, ["batch", MELS]),
        ],
        [
            helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["batch", "out_frames", VOCAB]),
            helper.make_tensor_value_info("state_out.0", TensorProto.FLOAT, ["batch", MELS]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "streaming-ctc",
                "vocab_size": VOCAB,
                "subsampling": SUB,
                "chunk_frames": CHUNK,
                "flush_frames": FLUSH,
                "blank_id": 0,
                "word_delimiter": "|",
                "state_shapes": {"state_in.0": [MELS]},
            }
        )
    )
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(TOKENS)}))
    # Centred features (mean ~ a speech frame's), so the running sum wanders and tokens vary.
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "feature_extractor_type": "LogMelFeatureExtractor",
                "sampling_rate": 16000,
                "n_fft": 400,
                "win_length": 400,
                "hop_length": 160,
                "num_mel_bins": MELS,
                "feature_size": MELS,
                "mel_scale": "slaney",
                "center": False,
                "log_floor": 1e-8,
                "mean": [-9.0] * MELS,
                "std": [3.0] * MELS,
                "padding_value": 0.0,
            }
        )
    )
    return folder


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    ref = inspect_folder(build_running_sum_model(tmp_path_factory.mktemp("sum") / "running-sum"))
    made = []

    def make(**kw):
        e = open_recognizer(ref, "onnxruntime", **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_folder_is_recognised_as_streaming_ctc(engine_factory):
    e = engine_factory()
    assert e.ref.kind == "asr-ctc-streaming" and e.ref.model_type == "streaming-ctc"
    assert e.kind == "streaming-ctc" and e.stateful and e.state_shapes == {"state_in.0": (MELS,)}


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
@pytest.mark.parametrize("chunk", [160, 1234, 5120])
def test_streaming_equals_whole_utterance_for_any_chunking(engine_factory, decoder, chunk):
    e = engine_factory(decoder=decoder)
    x = speech_samples("open the garage door")
    whole = e.transcribe(x)
    assert len(whole.token_ids) >= 3, "the test model should emit tokens on speech"
    s = e.new_stream()
    partials = []
    for i in range(0, len(x), chunk):
        s.add_audio(x[i : i + chunk])
        h = e.step([s])[0]
        if h is not None:
            partials.append(h)
    s.end()
    final = e.step([s])[0]
    assert final.final and final.token_ids == whole.token_ids and final.text == whole.text
    assert len(partials) >= 5
    # partials only grow (CTC streams natively: nothing already emitted is revised, greedy)
    if decoder == "greedy":
        ids = [p.token_ids for p in partials] + [final.token_ids]
        assert all(b[: len(a)] == a for a, b in pairwise(ids))


def test_scores_stream_exactly_like_the_whole_pass(engine_factory):
    e = engine_factory()
    x = speech_samples("open the garage door")
    whole = e.frame_scores(x)
    s = e.new_stream()
    seen = []
    original = s.decoder.advance
    s.decoder.advance = lambda lp: (seen.append(np.array(lp)), original(lp))
    for i in range(0, len(x), 3000):
        s.add_audio(x[i : i + 3000])
        e.step([s])
    s.end()
    e.step([s])
    streamed = np.concatenate(seen)
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=1e-3)


def test_batched_streams_equal_streams_alone(engine_factory):
    e = engine_factory()
    xs = [speech_samples(t) for t in ("open the garage door", "lights off", "set a timer for ten minutes")]
    alone = [e.transcribe(x).token_ids for x in xs]
    streams = [e.new_stream() for _ in xs]
    finals = [None] * len(xs)
    step = 2400
    for i in range(0, max(map(len, xs)) + step, step):
        for s, x in zip(streams, xs):
            if s.ended:
                continue
            if i < len(x):
                s.add_audio(x[i : i + step])
            else:
                s.end()
        for k, h in enumerate(e.step(streams)):
            if h is not None and h.final:
                finals[k] = h.token_ids
    assert finals == alone


def test_service_streams_the_stateful_model(engine_factory):
    e = engine_factory()
    x = speech_samples("open the garage door")
    with AsrService(e, limits=BatchLimits(max_batch=4, batch_timeout_ms=20)) as svc:
        hs = [svc.open_stream(vad=False) for _ in range(3)]
        from edge_agent.serving.asr.factory import feed_lockstep

        for h in hs:
            feed_lockstep(h, x, svc.chunk_samples)
        assert all(h.wait(30) for h in hs)
    want = e.transcribe(x).text
    assert [[f.text for f in h.finals] for h in hs] == [[want]] * 3
