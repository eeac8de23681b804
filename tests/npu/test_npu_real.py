"""The NPU tests on a real Intel NPU (no emulation), behind the ``npu`` marker.

Skipped with the reason where OpenVINO lists no NPU device (no Core Ultra, or no NPU driver). The
assertions are the emulated tests' ones, with the f16 numerics of the silicon in mind: greedy tokens
agree with ONNX Runtime's for the first steps, and the streamed transcript is the CPU's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from tests.speech import require_tools, speech_samples

pytestmark = pytest.mark.npu


@pytest.fixture(autouse=True)
def _real_npu() -> None:
    ov = pytest.importorskip("openvino")
    if "NPU" not in ov.Core().available_devices:
        pytest.skip("no NPU device here (needs an Intel Core Ultra with the intel-npu driver, /dev/accel/accel0)")


def test_llm_tokens_on_the_npu_start_as_onnxruntimes(tmp_path: Path) -> None:
    ref = resolve_model("demo-phi3", tmp_path / "models")
    reference = DecoderLM.open(ref, "onnxruntime")
    on_npu = DecoderLM.open(ref, "openvino", SessionOptions(device="NPU", extra={"npu_llm": npu.LlmShape(64, 64)}))
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(3, 1000, 40)]
        want = list(reference.generate_greedy(prompt, 4, stop_at_eos=False))
        assert list(on_npu.generate_greedy(prompt, 4, stop_at_eos=False))[:2] == want[:2]  # f16 may drift later
    finally:
        reference.close()
        on_npu.close()


def test_streamed_speech_on_the_npu_has_the_cpus_text(tmp_path: Path) -> None:
    require_tools()
    ref = resolve_model("demo-asr", tmp_path / "models")
    cpu = open_recognizer(ref, "onnxruntime", decoder="greedy")
    on_npu = open_recognizer(ref, "openvino", SessionOptions(device="NPU"), decoder="greedy")
    try:
        samples = speech_samples("turn on the kitchen lights")
        assert on_npu.transcribe(samples).text == cpu.transcribe(samples).text
    finally:
        cpu.close()
        on_npu.close()
