"""Wire models of ``tele/latency``: one telemetry window with its histograms, quantiles and device health."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ..metrics.histogram import ExponentialHistogram
from .wire import NAME, UINT64_MAX, WORKLOAD, MetricName, Wire, schema_field


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


REASON = r"^[a-z][a-z0-9_]{0,31}$"


class Refusals(BaseModel):
    """Requests of one workload and class refused at admission for one reason during the window."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    workload: str = Field(pattern=WORKLOAD)
    reason: str = Field(pattern=REASON, description="over_budget, start_deadline, queue_full, ...")
    class_: str = Field(alias="class", pattern=REASON, description="chat or interactive (voice turns)")
    count: int = Field(ge=1)


class Admission(BaseModel):
    """Refusals and preemptions during the window (counts in this window, like ``requests``): present
    when the agent counts them, so an empty object means none happened and a missing one means an
    agent that does not say."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    refused: list[Refusals] = Field(default_factory=list, max_length=64)
    preempted: dict[Annotated[str, StringConstraints(pattern=WORKLOAD)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        max_length=16,
        description="workload -> running requests that gave their row to a voice turn",
        json_schema_extra={"additionalProperties": False},  # a key that is no workload name is refused
    )


class LatencyWindow(Wire):
    """``tele/latency``: one telemetry window."""

    schema_: str = schema_field("tele.latency")
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
    admission: Admission | None = Field(None, description="refusals and preemptions in this window")
