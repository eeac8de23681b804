"""Wire payloads of every MQTT topic under ``edge/v1/<device_id>/``, as pydantic models.

Each payload carries ``schema`` (``edge-agent.<name>/<major>``): a receiver checks the name and
refuses a major it does not know; minor additions are new optional fields. The JSON Schema files
under ``schemas/`` are generated from these models and checked in, so fleet tools can validate
without Python:

    python -m edge_agent.telemetry.schema --write    # regenerate after changing a model
    python -m edge_agent.telemetry.schema --check    # exit 1 when a file is stale (a test runs this)

Pydantic runs at this edge only (once per window, event or command), never per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from ..metrics.histogram import ExponentialHistogram

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
UINT64_MAX = 2**64 - 1
WORKLOAD = r"^[a-z][a-z0-9_-]{0,31}$"
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Metrics a window may carry histograms for (the vocabulary of docs/metrics.md).
WINDOW_METRICS = (
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
    "queue_ms",
    "prefill_ms",
    "first_partial_ms",
    "final_ms",
    "turn_ms",
)
MetricName = Literal[
    "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "first_partial_ms", "final_ms", "turn_ms"
]
COMMAND_STATUSES = ("accepted", "executing", "succeeded", "failed", "expired", "rejected")


def schema_id(name: str, major: int = 1) -> str:
    return f"edge-agent.{name}/{major}"


class Wire(BaseModel):
    """Base of every payload: unknown keys refused, ``schema`` spelled as on the wire."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()


def _schema_field(name: str) -> Any:
    sid = schema_id(name)
    return Field(
        sid, alias="schema", pattern=f"^{sid.replace('.', '[.]')}$", description="payload name and major version"
    )


# -- histograms and windows ---------------------------------------------------------------------


class Buckets(BaseModel):
    """The populated buckets of one side of an exponential histogram: the first index and the counts from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    offset: int = 0
    bucketCounts: list[int] = Field(default_factory=list, max_length=4096)


class Histogram(BaseModel):
    """OpenTelemetry ExponentialHistogramDataPoint (OTLP JSON names): mergeable across devices."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scale: int = Field(ge=-10, le=20)
    zeroCount: int = Field(0, ge=0)
    zeroThreshold: float = Field(0.0, ge=0)
    positive: Buckets = Field(default_factory=Buckets)
    count: int = Field(ge=0)
    sum: float = Field(ge=0)
    min: float | None = Field(None, ge=0)
    max: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Histogram:
        ExponentialHistogram.from_dict(self.model_dump(exclude_none=True))  # raises ValueError naming the field
        return self

    @classmethod
    def of(cls, hist: ExponentialHistogram) -> Histogram:
        return cls.model_validate(hist.to_dict())

    def to_histogram(self) -> ExponentialHistogram:
        return ExponentialHistogram.from_dict(self.model_dump(exclude_none=True))


class LocalQuantiles(BaseModel):
    """Exact nearest-rank percentiles over this device's window: NOT for aggregation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    aggregatable: Literal[False] = Field(False, description="never average these: merge the histograms")
    count: int = Field(ge=0)
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


class Throughput(BaseModel):
    """Requests and generated tokens per second over the window."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    requests_per_s: float = Field(ge=0)
    tokens_per_s: float = Field(0.0, ge=0)


class Series(BaseModel):
    """One workload on one tier during one window."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    workload: str = Field(pattern=WORKLOAD)
    tier: str = Field(pattern=NAME)
    model: str = Field(max_length=256)
    engine_hash: str | None = Field(None, max_length=128)
    requests: int = Field(ge=0)
    errors: int = Field(0, ge=0)
    tokens_out: int = Field(0, ge=0)
    throughput: Throughput
    histograms: dict[MetricName, Histogram] = Field(default_factory=dict)
    relative_error: dict[MetricName, float] = Field(
        default_factory=dict, description="worst-case |estimate - true| / true of a quantile read from each histogram"
    )
    local: dict[MetricName, LocalQuantiles] = Field(default_factory=dict)


class WindowTimes(BaseModel):
    """The window's bounds on the wall clock and on the monotonic clock."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    start_wall: float
    end_wall: float
    start_mono: float
    end_mono: float
    duration_s: float = Field(ge=0, description="from the monotonic clock; the wall clock may jump")


class Health(BaseModel):
    """Device health over a window (``telemetry.health``): each source optional; a missing one is named in
    ``absent`` and its fields are null. Temperatures in °C, power in W, frequencies in MHz."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    process_cpu_percent: float | None = Field(None, ge=0, description="percent of one core, as top shows it")
    process_rss_bytes: int | None = Field(None, ge=0)
    memory_total_bytes: int | None = Field(None, ge=0)
    memory_available_bytes: int | None = Field(None, ge=0)
    load_1m: float | None = Field(None, ge=0)
    load_5m: float | None = Field(None, ge=0)
    load_15m: float | None = Field(None, ge=0)
    temperatures_c: dict[str, float] = Field(
        default_factory=dict, max_length=128, description="thermal zone type or hwmon chip/label -> °C"
    )
    max_temp_c: float | None = None
    cpu_freq_mhz_mean: float | None = Field(None, ge=0)
    cpu_freq_mhz_min: float | None = Field(None, ge=0)
    cpu_freq_mhz_max: float | None = Field(None, ge=0)
    throttle_counts: dict[str, int] = Field(
        default_factory=dict, max_length=8, description="thermal_throttle events since boot, summed over CPUs"
    )
    power_mode: str | None = Field(None, max_length=64, description="Jetson nvpmodel -q")
    rails_w: dict[str, float] = Field(default_factory=dict, max_length=32, description="INA3221 rails")
    rapl_power_w: dict[str, float] = Field(
        default_factory=dict, max_length=32, description="Intel RAPL domains, mean since the previous window"
    )
    npu_freq_mhz: float | None = Field(None, ge=0)
    npu_busy_percent: float | None = Field(None, ge=0, le=100)
    absent: list[str] = Field(default_factory=list, max_length=32, description="sources not present or not readable")


class LatencyWindow(Wire):
    """``tele/latency``: one telemetry window."""

    schema_: str = _schema_field("tele.latency")
    device_id: str = Field(pattern=NAME)
    session: int = Field(ge=0, le=UINT64_MAX, description="agent start counter, persisted")
    boot_id: str = Field(max_length=64)
    seq: int = Field(ge=0, le=UINT64_MAX, description="64-bit, monotonic across restarts; gaps mean loss")
    historical: bool = Field(False, description="true when replayed from the spool after a delay")
    clock_synced: bool
    clock_jump_s: float | None = Field(None, description="wall minus monotonic drift within the window, when > 1 s")
    window: WindowTimes
    series: list[Series] = Field(default_factory=list, max_length=256)
    version: str = Field(max_length=64)
    health: Health | None = Field(None, description="device health read as the window was sealed")


# -- device state ---------------------------------------------------------------------------------


class State(Wire):
    """``state`` (retained; also the Last Will, with state "offline")."""

    schema_: str = _schema_field("state")
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

    schema_: str = _schema_field("meta")
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
    metric: Literal["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "first_partial_ms", "final_ms", "turn_ms"] = "ttft_ms"
    percentile: float = Field(95.0, gt=0, le=100)
    target_ms: float = Field(gt=0, le=600_000)
    window_s: float = Field(30.0, gt=0, le=86_400)
    min_samples: int = Field(20, ge=1, le=1_000_000)


SourceKey = Annotated[str, StringConstraints(pattern=r"^(sla|pins)[.][a-z][a-z0-9_-]{0,31}$")]
SourceValue = Annotated[str, StringConstraints(pattern=r"^(file|command|desired@[0-9]{1,20})$")]


class Reported(Wire):
    """``reported`` (retained): what the device is doing now."""

    schema_: str = _schema_field("reported")
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

    schema_: str = _schema_field("desired")
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


# -- events ---------------------------------------------------------------------------------------


class Event(Wire):
    """``evt/<type>``: something happened (tier_switch, spool_drop, clock_jump, ...)."""

    schema_: str = _schema_field("event")
    device_id: str = Field(pattern=NAME)
    type: str = Field(pattern=WORKLOAD)
    session: int = Field(ge=0, le=UINT64_MAX)
    seq: int = Field(ge=0, le=UINT64_MAX, description="event stream seq, monotonic across restarts")
    historical: bool = False
    at_wall: float
    at_mono: float
    data: dict[str, Any] = Field(default_factory=dict)


class SpoolDrop(BaseModel):
    """``data`` of a ``spool_drop`` event: what the spool had to throw away, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    reason: Literal["full", "corrupt", "rejected", "disk_full"]
    windows: int = Field(0, ge=0)
    events: int = Field(0, ge=0)
    bytes: int = Field(0, ge=0)
    seq_ranges: list[tuple[int, int]] = Field(
        default_factory=list, description="lost tele/latency seq ranges, inclusive"
    )
    detail: str | None = Field(None, max_length=1024)


# -- commands -------------------------------------------------------------------------------------


class CommandRequest(Wire):
    """``cmd/<name>/req``. Use MQTT 5 response topic + correlation data; ``cmd_id`` makes retries safe."""

    schema_: str = _schema_field("cmd.request")
    cmd_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
    args: dict[str, Any] = Field(default_factory=dict)
    expires_at_wall: float | None = Field(None, description="unix time after which the device must not run it")


class CommandResponse(Wire):
    """``cmd/<name>/res`` (or the request's response topic); one message per status change."""

    schema_: str = _schema_field("cmd.response")
    device_id: str = Field(pattern=NAME)
    cmd_id: str | None = Field(None, max_length=64, description="null when the request was too malformed to read one")
    command: str = Field(max_length=64)
    status: Literal["accepted", "executing", "succeeded", "failed", "expired", "rejected"]
    reason: str | None = Field(None, max_length=1024)
    result: dict[str, Any] | None = None
    duplicate: bool = False
    at_wall: float


PAYLOADS: dict[str, type[Wire]] = {
    "tele_latency": LatencyWindow,
    "state": State,
    "meta": Meta,
    "reported": Reported,
    "desired": Desired,
    "event": Event,
    "cmd_request": CommandRequest,
    "cmd_response": CommandResponse,
}
SCHEMA_VERSIONS = {name: model.model_fields["schema_"].default for name, model in PAYLOADS.items()}


def json_schemas() -> dict[str, dict[str, Any]]:
    out = {}
    for name, model in PAYLOADS.items():
        schema = model.model_json_schema(by_alias=True, mode="serialization")
        schema["$id"] = f"https://edge-agent.invalid/schemas/{name}.json"
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[name] = schema
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def stale_files(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of schema files that are missing or differ from the models."""
    stale = []
    for name, schema in json_schemas().items():
        path = directory / f"{name}.json"
        if not path.is_file() or path.read_text() != render(schema):
            stale.append(path.name)
    return stale


def write_files(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in json_schemas().items():
        path = directory / f"{name}.json"
        path.write_text(render(schema))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m edge_agent.telemetry.schema", description="generate or check the checked-in JSON Schema files"
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help=f"write {SCHEMA_DIR}")
    g.add_argument("--check", action="store_true", help="exit 1 if a file is missing or stale")
    args = p.parse_args(argv)
    if args.write:
        for path in write_files():
            print(path)
        return 0
    stale = stale_files()
    if stale:
        print(
            f"stale JSON Schema files in {SCHEMA_DIR}: {', '.join(stale)}; "
            "run: python -m edge_agent.telemetry.schema --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
