"""Wire models of the device's retained topics: ``state``, ``meta`` (with the inventory), ``reported`` and
``desired`` (the fleet's SLA policy and tier pins)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from ..config.sla import SlaMetric
from .wire import NAME, UINT64_MAX, WORKLOAD, Wire, schema_field


class State(Wire):
    """``state`` (retained; also the Last Will, with state "offline")."""

    schema_: str = schema_field("state")
    device_id: str = Field(pattern=NAME)
    state: Literal["online", "offline", "degraded"]
    session: int = Field(ge=0, le=UINT64_MAX)
    boot_id: str = Field(max_length=64)
    version: str = Field(max_length=64)
    at_wall: float | None = None
    reason: str | None = Field(None, max_length=512)


class ServingEngine(BaseModel):
    """What one tier actually serves: the engine (or plain model folder) and how it was built."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    workload: str = Field(pattern=WORKLOAD)
    tier: str = Field(pattern=NAME)
    model: str = Field(max_length=256)
    identity: str | None = Field(None, max_length=128, description="engine:<cache key> or model:<sha256>")
    key: str | None = Field(None, max_length=128, description="engine cache key; null for a plain model folder")
    backend: str | None = Field(None, max_length=32)
    device: str | None = Field(None, max_length=256)
    precision: str | None = Field(None, max_length=32)
    built_at_wall: float | None = None
    build_s: float | None = Field(None, ge=0)
    gate: dict[str, Any] | None = Field(None, description="the accuracy gate's metrics and verdict")
    loaded: bool = Field(True, description="false for a configured tier not in memory now")


class Inventory(BaseModel):
    """What the device is and runs: host, accelerators, runtimes, and the engine behind each tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    agent_version: str = Field(max_length=64)
    config_digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="effective settings, secrets excluded")
    os: str | None = Field(None, max_length=128)
    kernel: str | None = Field(None, max_length=128)
    arch: str | None = Field(None, max_length=32)
    cpu_model: str | None = Field(None, max_length=256)
    cpu_cores: int | None = Field(None, ge=1)
    memory_bytes: int | None = Field(None, ge=0)
    jetson: dict[str, str | None] | None = Field(None, description="model, l4t, jetpack; null when not a Jetson")
    accelerators: dict[str, Any] = Field(
        default_factory=dict,
        description="cuda, tensorrt, openvino devices, onnxruntime providers, NPU nodes: what the probes found",
    )
    runtimes: dict[str, str] = Field(default_factory=dict, description="runtime -> version")
    serving: list[ServingEngine] = Field(default_factory=list, max_length=64)
    probed: bool = Field(False, description="false until the accelerator probes (run after start) have reported")
    absent: list[str] = Field(default_factory=list, max_length=32, description="what was looked for and not found")


class Meta(Wire):
    """``meta`` (retained): what the device can do."""

    schema_: str = schema_field("meta")
    device_id: str = Field(pattern=NAME)
    version: str = Field(max_length=64)
    capabilities: list[str] = Field(default_factory=list)
    tiers: dict[str, list[str]] = Field(default_factory=dict)
    engines: dict[str, str] = Field(default_factory=dict, description="engine name -> content hash")
    schemas: dict[str, str] = Field(default_factory=dict)
    histogram_relative_error: float = Field(ge=0, lt=1)
    warnings: list[str] = Field(
        default_factory=list, max_length=16, description="what the operator should fix, e.g. an open command channel"
    )
    inventory: Inventory | None = None
    calibration_capture: str = Field(
        "off",
        max_length=512,
        description="[calibration] capture: off, or what is captured where (opt-in; the prompts and voice stay "
        "on the device)",
    )


class SlaSpec(BaseModel):
    """A latency objective: a percentile of a metric under a target, over a window, with a minimum sample count."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    metric: SlaMetric = "ttft_ms"
    percentile: float = Field(95.0, gt=0, le=100)
    target_ms: float = Field(gt=0, le=600_000)
    window_s: float = Field(30.0, gt=0, le=86_400)
    min_samples: int = Field(20, ge=1, le=1_000_000)


SourceKey = Annotated[str, StringConstraints(pattern=r"^(sla|pins)[.][a-z][a-z0-9_-]{0,31}$")]
SourceValue = Annotated[str, StringConstraints(pattern=r"^(file|command|desired@[0-9]{1,20})$")]


class Reported(Wire):
    """``reported`` (retained): what the device is doing now."""

    schema_: str = schema_field("reported")
    device_id: str = Field(pattern=NAME)
    active_tiers: dict[str, str] = Field(default_factory=dict)
    pins: dict[str, str] = Field(default_factory=dict)
    sla: dict[str, SlaSpec] = Field(default_factory=dict)
    engine_hashes: dict[str, str] = Field(default_factory=dict)
    desired_version: int | None = Field(
        None,
        ge=0,
        description="the desired version in force now (applied in this "
        "run, or restored from the device's ledger at start)",
    )
    desired_error: str | None = Field(None, max_length=512)
    sources: dict[SourceKey, SourceValue] = Field(
        default_factory=dict,
        description="where each value in force comes from: 'sla.<workload>' and "
        "'pins.<workload>' -> 'file' (local config), 'command' or 'desired@<version>'",
    )
    at_wall: float | None = None


class Desired(Wire):
    """``desired`` (retained, fleet -> device): versioned SLA policy and tier pins."""

    schema_: str = schema_field("desired")
    version: int = Field(ge=0, le=UINT64_MAX)
    sla: dict[str, SlaSpec] = Field(default_factory=dict, description="workload -> SLA; absent = keep local")
    pins: dict[str, str | None] = Field(default_factory=dict, description="workload -> tier; null = unpin")

    @field_validator("sla", "pins")
    @classmethod
    def _workloads(cls, value: dict) -> dict:
        import re

        bad = [k for k in value if not re.match(WORKLOAD, k)]
        if bad:
            raise ValueError(f"not workload names: {bad}")
        return value
