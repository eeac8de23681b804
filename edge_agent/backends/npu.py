"""The Intel NPU through OpenVINO's NPU plugin: its compile properties, and its emulation on the CPU.

The NPU plugin has a second execution path, NPUW, that partitions a model and runs the parts on
devices it is given. Told to use the CPU (``NPUW_DEVICES=CPU``), it runs on a machine with no NPU and
applies the NPU's rules all the same: static shapes only, LLMs only in its LLM mode (a stateful IR with
``beam_idx``, a fixed prompt length and KV capacity). That is the emulation ``[device] npu_emulation``
turns on, so the NPU code paths run and are tested on any x86 machine:

- ``off``: device ``NPU`` is the real one (the intel-npu driver, ``/dev/accel/accel0``).
- ``cpu``: device ``NPU`` is present and every NPU compile goes through the plugin's NPUW on the CPU at
  f32 throughout (inference precision, the f16 input conversion turned off, an f32 KV cache): its
  results equal the CPU's, which is what equality tests need.
- ``cpu-f16``: the same, with the plugin's own f16 numerics (f16 KV cache, f16 inputs): closer to what
  the NPU computes, for accuracy budgets.

What the emulation proves: the plugin accepts the model and its shapes, and the pipeline around it
(stateful prefill and decode, static chunks, caching) is right. What it cannot prove: the NPU compiler's
own verdict on an operator, its speed, or its exact numerics. It is never silent: ``doctor``, the
start-up summary and ``meta`` (``accelerators.npu.emulated``) say so.

The setting lives in the environment (``EDGE_AGENT_DEVICE__NPU_EMULATION``, the variable the settings
read), so child processes (probes, builds) see the same NPU as the process that started them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

Emulation = Literal["off", "cpu", "cpu-f16"]
EMULATION_ENV = "EDGE_AGENT_DEVICE__NPU_EMULATION"


def emulation() -> Emulation:
    """The NPU emulation in force for this process (``off`` when unset or unknown)."""
    value = os.environ.get(EMULATION_ENV, "off").strip().lower()
    return cast(Emulation, value) if value in get_args(Emulation) else "off"


def set_emulation(mode: Emulation) -> None:
    """Make ``mode`` this process's (and its children's) NPU emulation."""
    if mode not in get_args(Emulation):
        raise ValueError(f"npu_emulation must be one of {get_args(Emulation)}, not {mode!r}")
    os.environ[EMULATION_ENV] = mode


def is_npu(device: str) -> bool:
    return device.upper().split(":")[0].split(".")[0] == "NPU"


def present(available: Sequence[str]) -> bool:
    """Whether device NPU can be compiled for: a real one, or the emulation."""
    return emulation() != "off" or any(d.startswith("NPU") for d in available)


def describe() -> str:
    """One line for logs, ``doctor`` and the start-up summary (empty when there is no emulation)."""
    mode = emulation()
    if mode == "off":
        return ""
    numerics = "f32 throughout" if mode == "cpu" else "the plugin's f16 numerics"
    return (
        f"NPU EMULATED on the CPU (npu_emulation = {mode!r}: OpenVINO's NPU plugin with NPUW on the CPU, "
        f"{numerics}); not an NPU: its speed and the NPU compiler's verdict are not measured"
    )


def blob_cache_exact() -> bool:
    """Whether a compiled blob imported from the cache computes what the compile did. Under the exact
    emulation it does not: NPUW's import runs the CPU parts without the f32 settings of the compile
    (measured: top-1 agreement 1.0 compiled, 0.95 imported), so NPU compiles skip the blob cache there."""
    return emulation() != "cpu"


@dataclass(frozen=True, slots=True)
class LlmShape:
    """What the plugin's LLM mode compiles: the longest prompt it prefills at once, the fewest tokens it
    must leave room for after it, and the most tokens one generate step takes (the rest of a longer prompt
    is fed through generate steps). The KV cache holds ``max_prompt + min_response`` tokens."""

    max_prompt: int = 1024
    min_response: int = 128
    generate_tokens: int = 1

    @property
    def capacity(self) -> int:
        # The plugin keeps one slot of the cache for the token a step writes (measured: 64 + 64 holds 127).
        return self.max_prompt + self.min_response - 1


def compile_properties(llm: LlmShape | None = None, mode: Emulation | None = None) -> dict[str, object]:
    """The NPU plugin's properties for one compile: the LLM mode when ``llm`` is given, the emulation's."""
    mode = emulation() if mode is None else mode
    props: dict[str, object] = {}
    if llm is not None:
        props.update(
            {
                "NPU_USE_NPUW": "YES",
                "NPUW_LLM": "YES",
                "NPUW_LLM_MAX_PROMPT_LEN": llm.max_prompt,
                "NPUW_LLM_MIN_RESPONSE_LEN": llm.min_response,
            }
        )
        if llm.generate_tokens > 1:
            props["NPUW_LLM_MAX_GENERATION_TOKEN_LEN"] = llm.generate_tokens
    if mode == "off":
        return props
    # NPUW on the CPU. Its online partitioning fails on some small exports ("Model references undeclared
    # parameters"): one partition is what the emulation needs. Its folding of repeated blocks unpacks
    # compressed weights with f32 scales only, and NNCF's INT4 weights carry f16 scales: no folding.
    props.update({"NPU_USE_NPUW": "YES", "NPUW_DEVICES": "CPU", "NPUW_ONLINE_PIPELINE": "NONE", "NPUW_FOLD": "NO"})
    if mode == "cpu":
        # The plugin's defaults turn a float32-minimum attention mask into -inf on the rows it pads (its
        # f16 input conversion; the CPU's bf16) and every logit into NaN; f32 throughout gives the CPU's tokens.
        props.update({"INFERENCE_PRECISION_HINT": "f32", "NPUW_F16IC": "NO"})
        if llm is not None:
            props["KV_CACHE_PRECISION"] = "f32"
    return props
