"""The NPU plugin's compile properties: the LLM mode's shape, and what each emulation adds."""

from __future__ import annotations

import pytest

from edge_agent.backends import SessionOptions, npu


def test_emulation_comes_from_the_settings_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert npu.emulation() == "off"
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu-f16")
    assert npu.emulation() == "cpu-f16"
    assert "f16 numerics" in npu.describe()
    monkeypatch.setenv(npu.EMULATION_ENV, "bogus")
    assert npu.emulation() == "off" and npu.describe() == ""


def test_a_real_npu_gets_the_llm_mode_and_nothing_of_the_emulation() -> None:
    props = npu.compile_properties(npu.LlmShape(max_prompt=256, min_response=64), mode="off")
    assert props == {
        "NPU_USE_NPUW": "YES",
        "NPUW_LLM": "YES",
        "NPUW_LLM_MAX_PROMPT_LEN": 256,
        "NPUW_LLM_MIN_RESPONSE_LEN": 64,
    }
    assert npu.compile_properties(None, mode="off") == {}


def test_the_exact_emulation_runs_npuw_on_the_cpu_at_f32_throughout() -> None:
    props = npu.compile_properties(npu.LlmShape(generate_tokens=8), mode="cpu")
    assert props["NPUW_DEVICES"] == "CPU" and props["NPU_USE_NPUW"] == "YES"
    assert props["INFERENCE_PRECISION_HINT"] == "f32" and props["NPUW_F16IC"] == "NO"
    assert props["KV_CACHE_PRECISION"] == "f32"
    assert props["NPUW_LLM_MAX_GENERATION_TOKEN_LEN"] == 8
    f16 = npu.compile_properties(npu.LlmShape(), mode="cpu-f16")
    assert f16["NPUW_DEVICES"] == "CPU" and "NPUW_F16IC" not in f16 and "KV_CACHE_PRECISION" not in f16


def test_the_kv_capacity_is_prompt_plus_response_less_the_slot_a_step_writes() -> None:
    assert npu.LlmShape(max_prompt=64, min_response=64).capacity == 127


def test_the_backend_config_for_an_npu_drops_cpu_threads_and_adds_the_plugin_properties(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("openvino")
    from edge_agent.backends.openvino import compile_config

    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    config = compile_config(SessionOptions(device="NPU", threads=2, extra={"npu_llm": npu.LlmShape()}))
    assert "INFERENCE_NUM_THREADS" not in config and config["NPUW_LLM"] == "YES"
    assert compile_config(SessionOptions(device="CPU", threads=2))["INFERENCE_NUM_THREADS"] == "2"
