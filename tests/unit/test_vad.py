"""Energy VAD and the endpointing state machine, on synthetic signals with known timings."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.audio.vad import (
    EndpointConfig,
    Endpointer,
    EnergyVAD,
    SpeechAudio,
    SpeechEnd,
    SpeechStart,
    make_detector,
)
from edge_agent.errors import InputError, ModelError

RATE = 16000


def signal(*parts: tuple[str, float], noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """Concatenate ("tone"|"quiet", seconds) parts; optional background noise everywhere."""
    rng = np.random.default_rng(seed)
    out = []
    for kind, seconds in parts:
        n = int(seconds * RATE)
        t = np.arange(n) / RATE
        out.append(0.3 * np.sin(2 * np.pi * 300 * t) if kind == "tone" else np.zeros(n))
    x = np.concatenate(out)
    return (x + noise * rng.standard_normal(x.size)).astype(np.float32)


def run(endpointer: Endpointer, x: np.ndarray, block: int = 320) -> list:
    events = []
    for i in range(0, x.size, block):
        events += endpointer.push(x[i : i + block])
    return events + endpointer.flush()


def kinds(events):
    return [type(e).__name__ for e in events if not isinstance(e, SpeechAudio)]


def test_energy_vad_voiced_vs_silence_and_adapts_to_steady_noise():
    vad = EnergyVAD()
    frame = vad.frame_samples
    assert vad.is_speech(signal(("tone", 0.02))[:frame])
    assert not vad.is_speech(np.zeros(frame, np.float32))
    vad.reset()
    noise = signal(("quiet", 10.0), noise=0.01)  # -40 dBFS hiss, above the absolute floor
    voiced = [vad.is_speech(noise[i : i + frame]) for i in range(0, noise.size - frame, frame)]
    assert sum(voiced[-100:]) == 0, "steady noise must stop counting as speech"
    assert vad.is_speech(signal(("tone", 0.02), noise=0.01)[:frame])


@pytest.mark.parametrize(
    "parts, expected_starts, expected_ends",
    [
        # one utterance: onset at 0.5 s, ends after 0.5 s of trailing silence
        ((("quiet", 0.5), ("tone", 1.0), ("quiet", 1.0)), [0.5], [(2.0, 1.5, "silence")]),
        # a 40 ms click is shorter than min_speech_ms: no utterance
        ((("quiet", 0.5), ("tone", 0.04), ("quiet", 1.0)), [], []),
        # a pause shorter than trailing_silence_ms does not split the utterance
        (
            (("quiet", 0.3), ("tone", 0.5), ("quiet", 0.3), ("tone", 0.5), ("quiet", 1.0)),
            [0.3],
            [(2.1, 1.6, "silence")],
        ),
        # two utterances
        (
            (("tone", 0.5), ("quiet", 0.8), ("tone", 0.5), ("quiet", 0.6)),
            [0.0, 1.3],
            [(1.0, 0.5, "silence"), (2.3, 1.8, "silence")],
        ),
        # speech running into the end of the stream
        ((("quiet", 0.2), ("tone", 0.6)), [0.2], [(0.8, 0.8, "end_of_stream")]),
    ],
)
def test_endpointer_timings(parts, expected_starts, expected_ends):
    ep = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=100, trailing_silence_ms=500, pre_roll_ms=200))
    events = run(ep, signal(*parts))
    starts = [e.at_s for e in events if isinstance(e, SpeechStart)]
    ends = [(e.at_s, e.speech_end_s, e.reason) for e in events if isinstance(e, SpeechEnd)]
    assert starts == pytest.approx(expected_starts, abs=0.021)
    assert [(round(a, 2), round(b, 2), r) for a, b, r in ends] == [
        (pytest.approx(a, abs=0.021), pytest.approx(b, abs=0.021), r) for a, b, r in expected_ends
    ]


def test_utterance_audio_is_pre_roll_plus_everything_until_the_end():
    x = signal(("quiet", 1.0), ("tone", 1.0), ("quiet", 1.0))
    ep = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=100, trailing_silence_ms=500, pre_roll_ms=200))
    events = run(ep, x)
    start = next(e for e in events if isinstance(e, SpeechStart))
    audio = np.concatenate([start.audio] + [e.audio for e in events if isinstance(e, SpeechAudio)])
    # 200 ms pre-roll + 100 ms confirming onset, then 0.9 s tone + 0.5 s trailing silence
    assert audio.size == int((0.2 + 1.0 + 0.5) * RATE)
    onset = int(1.0 * RATE) - int(0.2 * RATE)
    np.testing.assert_array_equal(audio, x[onset : onset + audio.size])


def test_max_length_splits_a_long_utterance():
    ep = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=100, trailing_silence_ms=500, max_utterance_s=2.0))
    syllables = [("tone", 0.2), ("quiet", 0.06)] * 20  # 5.2 s of speech-like bursts
    events = run(ep, signal(*syllables, ("quiet", 1.0)))
    reasons = [e.reason for e in events if isinstance(e, SpeechEnd)]
    assert reasons[:2] == ["max_length", "max_length"] and len(reasons) == 3


def test_steady_tone_longer_than_the_adaptation_window_becomes_background():
    ep = Endpointer(EnergyVAD(adapt_s=3.0), EndpointConfig(min_speech_ms=100, trailing_silence_ms=500))
    ends = [e for e in run(ep, signal(("tone", 6.0), ("quiet", 1.0))) if isinstance(e, SpeechEnd)]
    assert len(ends) == 1 and ends[0].reason == "silence" and 3.0 <= ends[0].speech_end_s <= 3.2


def test_no_detector_means_the_whole_stream_is_one_utterance():
    ep = Endpointer(None)
    x = signal(("quiet", 0.5), ("tone", 0.5), ("quiet", 0.51))
    events = run(ep, x, block=333)
    assert kinds(events) == ["SpeechStart", "SpeechEnd"]
    start = events[0]
    total = start.audio.size + sum(e.audio.size for e in events if isinstance(e, SpeechAudio))
    assert total == x.size  # the partial last frame is not lost


def test_endpointer_is_independent_of_block_size():
    x = signal(("quiet", 0.4), ("tone", 0.7), ("quiet", 0.7), ("tone", 0.3), ("quiet", 0.7), noise=0.002)
    runs = [run(Endpointer(EnergyVAD()), x, block) for block in (160, 320, 1234, 16000)]
    summaries = [
        [(type(e).__name__, round(getattr(e, "at_s", 0), 3)) for e in r if not isinstance(e, SpeechAudio)] for r in runs
    ]
    assert all(s == summaries[0] for s in summaries) and len(summaries[0]) == 4


def test_detector_options_fail_clearly():
    with pytest.raises(InputError, match="vad_model"):
        make_detector("silero")
    with pytest.raises(ModelError, match="does not exist"):
        make_detector("silero", model="/nonexistent/silero_vad.onnx")
    with pytest.raises(InputError, match="unknown vad"):
        make_detector("loudness")  # type: ignore[arg-type]
    try:
        make_detector("webrtc")
    except InputError as exc:
        assert "pip install webrtcvad" in str(exc)


def _silero_contract_model(path):
    """An ONNX file with Silero VAD v5's I/O (input [1, 576], state [2, 1, 128], sr → output [1, 1],
    stateN): probability = sigmoid(2000 · mean(x²) − 4), the state counts calls. Tests the wiring,
    not Silero's accuracy."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Mul", ["input", "input"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], keepdims=1),
        helper.make_node("Mul", ["ms", "gain"], ["z0"]),
        helper.make_node("Sub", ["z0", "bias"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["output"]),
        helper.make_node("Add", ["state", "one"], ["stateN"]),
    ]
    graph = helper.make_graph(
        nodes,
        "silero_contract",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 576]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, 128]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 1]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, 1, 128]),
        ],
        [
            numpy_helper.from_array(np.array(2000.0, np.float32), "gain"),
            numpy_helper.from_array(np.array(4.0, np.float32), "bias"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def test_silero_vad_runs_a_v5_contract_model_with_context_and_state(tmp_path):
    from edge_agent.audio.vad import SileroVAD

    vad = make_detector("silero", model=_silero_contract_model(tmp_path / "silero_vad.onnx"))
    assert isinstance(vad, SileroVAD) and vad.frame_samples == 512
    assert not vad.is_speech(np.zeros(512, np.float32))
    assert vad.is_speech(signal(("tone", 0.032))[:512])
    assert float(vad._state.max()) == 2.0  # the state went through both calls
    ep = Endpointer(vad, EndpointConfig(min_speech_ms=96, trailing_silence_ms=320))
    events = run(ep, signal(("quiet", 0.5), ("tone", 1.0), ("quiet", 1.0)), block=512)
    assert kinds(events) == ["SpeechStart", "SpeechEnd"]
