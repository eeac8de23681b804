"""The NPU path on exports made by optimum's ONNX exporter (tests/data, scripts/make_npu_test_exports.py).

The demo models are exported with torch.onnx.export; users export with ``optimum-cli export onnx --task
text-generation-with-past``, whose graphs compute the causal mask, the sliding window and the past length
their own way. Through the NPU plugin run on the CPU (``npu_emulation = "cpu"``) greedy tokens must equal
ONNX Runtime's on the same folder, for a short prompt and for one longer than the compiled prompt length
(the rest fed through generate steps), 32 tokens each: past Gemma-2's 16-token sliding window.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM

pytest.importorskip("openvino")

DATA = Path(__file__).resolve().parent.parent / "data"
SHAPE = npu.LlmShape(max_prompt=64, min_response=64)  # a KV cache of 127 tokens
# (length, seed): 6 tokens fit one prefill; 90 is longer than the compiled prompt (64). The export script
# checked every greedy step of these prompts against PyTorch, clear of near-ties.
PROMPTS = ((6, 0), (90, 1))
N_NEW = 32

EXPORTS = [
    "phi3-optimum-tiny",
    "phi3-gqa-tiny",
    # optimum exports Gemma-2 without a position_ids input: its rotary positions come from the past's
    # shape (a constant under the NPU's fixed cache) until the conversion adds the input and feeds them
    "gemma2-optimum-tiny",
]


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")


def _prompt(lm: DecoderLM, n: int, seed: int) -> list[int]:
    high = min(lm.tokenizer.vocab_size, lm.vocab_limit or 10**9)
    return [int(t) for t in np.random.default_rng(seed).integers(3, high, n)]


@pytest.mark.parametrize("name", EXPORTS)
def test_greedy_tokens_of_an_optimum_export_on_the_emulated_npu_equal_onnxruntime(
    emulated, tmp_path: Path, name: str
) -> None:
    ref = resolve_model(DATA / name, tmp_path / "models")
    reference = DecoderLM.open(ref, "onnxruntime")
    try:
        window = ref.config.get("sliding_window")
        options = SessionOptions(device="NPU", extra={"npu_llm": SHAPE, "sliding_window": window})
        on_npu = DecoderLM.open(ref, "openvino", options)
        try:
            assert on_npu.max_rows == 1 and on_npu.npu_shape == SHAPE
            for n, seed in PROMPTS:
                prompt = _prompt(reference, n, seed)
                want = list(reference.generate_greedy(prompt, N_NEW, stop_at_eos=False))
                got = list(on_npu.generate_greedy(prompt, N_NEW, stop_at_eos=False))
                assert got == want, f"{name}, {n}-token prompt: first differing step {_first_difference(got, want)}"
        finally:
            on_npu.close()
    finally:
        reference.close()


def _first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


@pytest.mark.parametrize(
    ("name", "window_rewrites", "positions_added"),
    [("phi3-optimum-tiny", 0, 0), ("phi3-gqa-tiny", 0, 0), ("gemma2-optimum-tiny", 1, 2)],
)
def test_the_stateful_conversion_of_an_optimum_export(
    tmp_path: Path, name: str, window_rewrites: int, positions_added: int
) -> None:
    import openvino as ov

    from edge_agent.backends.openvino_stateful import is_stateful, make_stateful

    ref = resolve_model(DATA / name, tmp_path / "models")
    model = ov.Core().read_model(str(ref.path / "model.onnx"))
    done = make_stateful(model, ref.config.get("sliding_window"), SHAPE.capacity)
    assert done["kv_states"] == 2 * ref.config["num_hidden_layers"]
    assert done["sliding_window_rewrites"] == window_rewrites and done["mask_minimum_clamped"] >= 1
    assert done["position_ids_added"] == positions_added
    assert is_stateful(model) and "position_ids" in {n for p in model.inputs for n in p.get_names()}


def test_optimums_gemma2_export_is_served_by_onnxruntime_without_position_ids(tmp_path: Path) -> None:
    """The folder itself is sound: ONNX Runtime serves it (positions from the past's length)."""
    ref = resolve_model(DATA / "gemma2-optimum-tiny", tmp_path / "models")
    assert ref.config["sliding_window"] == 16
    reference = DecoderLM.open(ref, "onnxruntime")
    try:
        assert not reference.contract.has_position_ids
        assert len(list(reference.generate_greedy(_prompt(reference, 6, 0), 8, stop_at_eos=False))) == 8
    finally:
        reference.close()
