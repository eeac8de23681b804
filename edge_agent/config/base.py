"""The platform every section builds on: the ``Section`` base, ``[device]``, the backend and precision
names, and the per-user cache and state directories that default paths live under."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["onnxruntime", "openvino", "tensorrt", "fake"]
INTERNAL_BACKENDS = ("fake",)  # accepted (tests, benchmarks), never offered in a message to users
Precision = Literal["auto", "fp32", "fp16", "bf16", "int8"]


def user_dir(kind: Literal["cache", "state"]) -> Path:
    # Under systemd, CacheDirectory=/StateDirectory= export these; they win over the user's dirs.
    env = os.environ.get("CACHE_DIRECTORY" if kind == "cache" else "STATE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])
    import platformdirs

    getter = platformdirs.user_cache_dir if kind == "cache" else platformdirs.user_state_dir
    return Path(getter("edge-agent"))


def default_cache_dir() -> Path:
    return user_dir("cache")


class Section(BaseModel):
    """A configuration section: unknown keys are errors and assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DeviceConfig(Section):
    """``[device]``: the target platform and the runtime's intra-op threads."""

    target: Literal["auto", "cpu", "jetson", "intel-npu"] = "auto"
    threads: int = Field(0, ge=0, description="intra-op threads per session; 0 = the runtime's default")
    npu_emulation: Literal["off", "cpu", "cpu-f16"] = Field(
        "off",
        description="device NPU through OpenVINO's NPU plugin run on the CPU (NPUW): 'cpu' at f32 (the CPU's "
        "results), 'cpu-f16' with the plugin's f16 numerics; for testing NPU tiers without an NPU (docs/npu.md)",
    )
