"""LLM tiers on the NPU, through OpenVINO's own NPU plugin run on the CPU (``npu_emulation = "cpu"``).

The plugin's LLM mode is what runs an LLM on a Core Ultra NPU: a stateful IR, a prompt padded to a
compiled length, a fixed-size KV cache. Under the emulation it runs on the CPU with the NPU's rules and
f32 numerics, so greedy tokens must equal ONNX Runtime's on the same export, token for token: for short
prompts, for prompts longer than the compiled prompt length (the rest fed through generate steps), past
Gemma-2's sliding window, and through the serving scheduler.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.errors import DeviceUnavailable, InputError
from edge_agent.models.catalog import resolve_model
from edge_agent.models.llm import DecoderLM
from edge_agent.models.sampling import SamplingParams
from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

pytest.importorskip("openvino")

SHAPE = npu.LlmShape(max_prompt=64, min_response=64)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")


def _open_pair(name: str, tmp_path: Path, shape: npu.LlmShape = SHAPE) -> tuple[DecoderLM, DecoderLM]:
    ref = resolve_model(name, tmp_path / "models")
    reference = DecoderLM.open(ref, "onnxruntime")
    options = SessionOptions(device="NPU", extra={"npu_llm": shape, "sliding_window": ref.config.get("sliding_window")})
    return reference, DecoderLM.open(ref, "openvino", options)


def _prompt(lm: DecoderLM, n: int, seed: int) -> list[int]:
    high = min(lm.tokenizer.vocab_size, lm.vocab_limit or 10**9)
    return [int(t) for t in np.random.default_rng(seed).integers(3, high, n)]


@pytest.mark.parametrize("name", ["demo-phi3", "demo-gemma", "demo-gemma2"])
def test_greedy_tokens_on_the_emulated_npu_equal_onnxruntime(emulated, tmp_path: Path, name: str) -> None:
    reference, on_npu = _open_pair(name, tmp_path)
    try:
        assert on_npu.max_rows == 1 and on_npu.npu_shape == SHAPE
        assert on_npu.contract.max_context == SHAPE.capacity
        # 5 and 40 tokens fit one prefill; 100 is longer than the compiled prompt (64): the rest goes
        # through generate steps. 24 new tokens run past demo-gemma2's 16-token sliding window.
        for n, seed in ((5, 0), (40, 1), (100, 2)):
            prompt = _prompt(reference, n, seed)
            want = list(reference.generate_greedy(prompt, 24, stop_at_eos=False))
            got = list(on_npu.generate_greedy(prompt, 24, stop_at_eos=False))
            assert got == want, f"{name}, {n}-token prompt"
    finally:
        reference.close()
        on_npu.close()


def test_generate_steps_of_several_tokens_feed_a_long_prompt_the_same(emulated, tmp_path: Path) -> None:
    shape = npu.LlmShape(max_prompt=64, min_response=64, generate_tokens=8)
    reference, on_npu = _open_pair("demo-phi3", tmp_path, shape)
    try:
        prompt = _prompt(reference, 90, 3)
        want = list(reference.generate_greedy(prompt, 16, stop_at_eos=False))
        assert list(on_npu.generate_greedy(prompt, 16, stop_at_eos=False)) == want
    finally:
        reference.close()
        on_npu.close()


def test_a_sequence_that_would_overflow_the_kv_state_is_refused_before_it_runs(emulated, tmp_path: Path) -> None:
    reference, on_npu = _open_pair("demo-phi3", tmp_path)
    try:
        with pytest.raises(InputError, match="exceeds the model's context of 127"):
            on_npu.check_prompt(_prompt(reference, 120, 4), 16)
    finally:
        reference.close()
        on_npu.close()


def test_the_scheduler_serves_one_sequence_at_a_time_and_every_request_completes(emulated, tmp_path: Path) -> None:
    reference, on_npu = _open_pair("demo-phi3", tmp_path)
    prompts = [_prompt(reference, n, seed) for n, seed in ((12, 5), (30, 6), (70, 7))]
    wants = [list(reference.generate_greedy(p, 20, stop_at_eos=False)) for p in prompts]
    reference.close()
    scheduler = LLMScheduler(on_npu, Limits(max_batch=4, batch_timeout_ms=0)).start()
    try:
        assert scheduler.limits.max_batch == 1
        params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
        handles = [scheduler.submit(p, params) for p in prompts]
        done = [h.result() for h in handles]
    finally:
        scheduler.stop()
        on_npu.close()
    assert [list(d.token_ids) for d in done] == wants
    assert all(d.finish_reason == "length" for d in done)


def test_without_the_emulation_or_a_driver_the_npu_is_absent(tmp_path: Path) -> None:
    ref = resolve_model("demo-phi3", tmp_path / "models")
    import openvino as ov

    if "NPU" in ov.Core().available_devices:
        pytest.skip("this machine has a real NPU")
    with pytest.raises(DeviceUnavailable, match="NPU"):
        DecoderLM.open(ref, "openvino", SessionOptions(device="NPU"))


def test_a_sliding_window_that_cannot_be_found_is_refused_when_the_cache_is_wider(tmp_path: Path) -> None:
    import openvino as ov

    from edge_agent.backends.openvino_stateful import make_stateful
    from edge_agent.errors import ModelError

    ref = resolve_model("demo-phi3", tmp_path / "models")  # its export has no window test to rewrite
    with pytest.raises(ModelError, match="sliding window of 16 tokens is narrower than the NPU's cache of 127"):
        make_stateful(ov.Core().read_model(str(ref.path / "model.onnx")), sliding_window=16, capacity=127)
    # a window the cache never exceeds cannot mask anything wrongly: converted as it is
    done = make_stateful(ov.Core().read_model(str(ref.path / "model.onnx")), sliding_window=4096, capacity=127)
    assert done["sliding_window_rewrites"] == 0 and done["kv_states"] == 4


def test_gemma2s_window_is_rewritten_on_positions(tmp_path: Path) -> None:
    import openvino as ov

    from edge_agent.backends.openvino_stateful import make_stateful

    ref = resolve_model("demo-gemma2", tmp_path / "models")
    done = make_stateful(ov.Core().read_model(str(ref.path / "model.onnx")), ref.config["sliding_window"], 127)
    assert done["sliding_window_rewrites"] >= 1 and done["mask_minimum_clamped"] >= 1


def test_structured_output_logprobs_and_cancel_on_the_npu_tier(emulated, tmp_path: Path) -> None:
    """The NPU tier runs the same scheduler path: a format mask, logprobs, and a cancelled sequence that
    frees the NPU for the next one (whose tokens are still the export's)."""
    import json as _json

    from edge_agent.models.grammar import json_schema_grammar

    reference, on_npu = _open_pair("demo-phi3", tmp_path)
    prompt = _prompt(reference, 20, 9)
    want = list(reference.generate_greedy(prompt, 12, stop_at_eos=False))
    reference.close()
    scheduler = LLMScheduler(on_npu, Limits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
        shaped = scheduler.submit(
            prompt, SamplingParams(max_new_tokens=40, grammar=json_schema_grammar(schema), logprobs=2)
        ).result()
        assert _json.loads(shaped.text)["on"] in (True, False)
        assert len(shaped.logprobs) == len(shaped.token_ids)
        assert all(lp.token_id == t and 1 <= len(lp.top) <= 2 for lp, t in zip(shaped.logprobs, shaped.token_ids))
        cancelled = scheduler.submit(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
        events = iter(cancelled)
        next(events)  # it holds the NPU's one sequence now
        cancelled.cancel()
        assert cancelled.result().finish_reason == "cancelled"
        after = scheduler.submit(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).result()
    finally:
        scheduler.stop()
        on_npu.close()
    assert list(after.token_ids) == want
