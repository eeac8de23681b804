"""A streaming CTC tier on the NPU (OpenVINO's NPU plugin on the CPU, ``npu_emulation = "cpu"``).

The NPU compiles static shapes: one stream, one chunk of the model's ``chunk_frames``. Whole chunks run
as the audio comes; the tail (rarely a whole chunk) is padded to whole chunks and the padding's output
frames are dropped. The streamed text must equal the CPU's on real speech, and so must the log-probs
of every frame.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from tests.speech import require_tools, speech_samples

pytest.importorskip("openvino")


def _stream(engine, samples: np.ndarray, block: int = 1600):
    s = engine.new_stream()
    hyp = None
    for i in range(0, len(samples), block):
        s.add_audio(samples[i : i + block])
        hyp = engine.step([s])[0] or hyp
    s.end()
    return engine.step([s])[0] or hyp, s


@pytest.mark.parametrize(
    "text, voice",
    [("turn on the kitchen lights", "en-us"), ("set a timer for ten minutes please", "en+max")],
)
def test_streamed_text_on_the_emulated_npu_equals_the_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, voice: str
) -> None:
    require_tools()
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    ref = resolve_model("demo-asr", tmp_path / "models")
    cpu = open_recognizer(ref, "onnxruntime", decoder="greedy")
    on_npu = open_recognizer(ref, "openvino", SessionOptions(device="NPU"), decoder="greedy")
    try:
        assert on_npu.fixed_shape == (1, ref.config["chunk_frames"])
        samples = speech_samples(text, voice)
        want, want_stream = _stream(cpu, samples)
        got, got_stream = _stream(on_npu, samples)
        assert got.final and want.final
        assert got.text == want.text and got.token_ids == want.token_ids
        # the tail is not a whole chunk here, so padding was added and its output frames dropped
        assert on_npu.transcribe(samples).text == cpu.transcribe(samples).text
    finally:
        cpu.close()
        on_npu.close()


def test_frame_scores_of_padded_chunks_equal_one_whole_pass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    require_tools()
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    ref = resolve_model("demo-asr", tmp_path / "models")
    cpu = open_recognizer(ref, "onnxruntime", decoder="greedy")
    on_npu = open_recognizer(ref, "openvino", SessionOptions(device="NPU"), decoder="greedy")
    try:
        samples = speech_samples("what is the weather like tomorrow", "en-us")
        whole, chunked = cpu.frame_scores(samples), on_npu.frame_scores(samples)
        assert chunked.shape == whole.shape
        np.testing.assert_allclose(chunked, whole, atol=2e-4)
    finally:
        cpu.close()
        on_npu.close()
