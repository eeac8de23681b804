"""``[sla]`` and ``[sla.asr]``: the latency targets each workload's tier ladder keeps, and the scenario presets."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

# Scenario SLAs (P95 unless noted): the abandonment cliff is the default.
SlaPreset = Literal[
    "default",
    "chit-chat",
    "customer-service",
    "medical-consultation",
    "live-risk-control",
    "video-conferencing",
    "asr-customer-service",
]
SLA_PRESETS: dict[SlaPreset, dict[str, Any]] = {
    "default": {"metric": "ttft_ms", "percentile": 95, "target_ms": 387.0},
    "chit-chat": {"metric": "ttft_ms", "percentile": 95, "target_ms": 350.0},
    "customer-service": {"metric": "ttft_ms", "percentile": 95, "target_ms": 220.0},
    "medical-consultation": {"metric": "ttft_ms", "percentile": 95, "target_ms": 150.0},
    "live-risk-control": {"metric": "ttft_ms", "percentile": 99, "target_ms": 85.0},
    "video-conferencing": {"metric": "ttft_ms", "percentile": 99, "target_ms": 150.0},
    "asr-customer-service": {"metric": "first_partial_ms", "percentile": 95, "target_ms": 300.0},
}


AsrSlaMetric = Literal["first_partial_ms", "final_ms"]
# Every metric an SLA may name (``sla_metric_problem`` says which fit which workload)
SlaMetric = Literal["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "first_partial_ms", "final_ms", "turn_ms"]
ASR_SLA_METRICS: tuple[str, ...] = typing.get_args(AsrSlaMetric)
# What each workload's tier controller gets samples of (an LLM request's timing, an ASR utterance):
# an SLA on anything else would never see a sample, so its controller would never act.
LLM_SLA_METRICS: tuple[str, ...] = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
SLA_METRICS: dict[str, tuple[str, ...]] = {"llm": LLM_SLA_METRICS, "asr": ASR_SLA_METRICS}


def sla_metric_problem(workload: str, metric: str) -> str | None:
    """Why ``metric`` cannot be ``workload``'s SLA metric, or None when it can. The one check for every
    way an SLA arrives: the config file (``SlaConfig``, ``AsrSlaConfig``), a ``set_sla`` command (the
    command processor and ``RemoteTarget.set_sla``), a ``desired`` document, and a reload."""
    allowed = SLA_METRICS.get(workload)
    if allowed is None:
        return f"no SLA for workload {workload!r}; SLAs exist for {', '.join(SLA_METRICS)}"
    if metric in allowed:
        return None
    return (
        f"the {workload.upper()} SLA metric must be one of {', '.join(allowed)}, not {metric!r}: the "
        f"{workload.upper()} tier controller gets no samples of it, so it would never act"
    )


class _SlaPolicy(Section):
    """What every workload's SLA policy has: the metric's percentile against a target over a rolling
    window, and the tier controller's hysteresis, cooldown, dwell and shedding
    (``serving.tiers.policy.decide``)."""

    preset: SlaPreset | None = None
    percentile: float = Field(95, gt=0, le=100)
    window_s: float = Field(30.0, gt=0)
    min_samples: int = Field(20, ge=1)
    evaluate_every_s: float = Field(10.0, gt=0)
    downgrade_after: int = Field(3, ge=1, description="consecutive evaluations over target before a downgrade")
    upgrade_after: int = Field(6, ge=1, description="consecutive evaluations under upgrade_ratio × target")
    upgrade_ratio: float = Field(0.7, gt=0, lt=1)
    cooldown_s: float = Field(60.0, ge=0, description="since the last switch, before an upgrade")
    min_dwell_s: float = Field(30.0, ge=0, description="in a tier before any switch")
    shed_after: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _apply_preset(self) -> _SlaPolicy:
        if self.preset:
            for key, value in SLA_PRESETS[self.preset].items():
                if key not in self.model_fields_set:
                    object.__setattr__(self, key, value)
        return self

    def _check_preset_metric(self, workload: str, metric: str) -> None:
        """A preset's metric bypasses field validation (an explicit one is checked on its field, with
        its path): an LLM preset under ``[sla.asr]`` or an ASR one under ``[sla]`` is refused here."""
        problem = sla_metric_problem(workload, metric)
        if problem is not None:
            fitting = [n for n, p in SLA_PRESETS.items() if sla_metric_problem(workload, p["metric"]) is None]
            raise ValueError(
                f"preset {self.preset!r} sets metric {metric!r}: {problem}; presets for "
                f"{workload.upper()}: {', '.join(fitting)}"
            )


class AsrSlaConfig(_SlaPolicy):
    """``[sla.asr]``: the ASR tier ladder's policy (AI customer-service ASR: first partial ≤ 300 ms, P95).
    No token cap and no adaptive batch here: at the lightest tier, over target goes straight to the
    shedding count."""

    metric: AsrSlaMetric = "first_partial_ms"
    target_ms: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _asr_metric(self) -> AsrSlaConfig:
        self._check_preset_metric("asr", self.metric)
        return self


class SlaConfig(_SlaPolicy):
    """``[sla]``: the LLM policy (flat keys, as before), and ``[sla.asr]`` for the ASR ladder."""

    metric: SlaMetric = "ttft_ms"
    target_ms: float = Field(387.0, gt=0)
    adaptive_batch: Literal["auto", "on", "off"] = "auto"
    min_batch: int = Field(1, ge=1)
    min_token_cap_ratio: float = Field(0.25, gt=0, le=1)
    max_temp_c: float | None = Field(None, gt=0, le=150, description="opt-in: a lighter tier at this temperature")
    spill_ttft_ms: float | None = Field(
        None,
        gt=0,
        description="a busy NPU tier hands a request to the tier beside it when its expected first token is "
        "later than this; default: target_ms for ttft_ms and e2e_ms, else 387 (docs/npu.md)",
    )
    asr: AsrSlaConfig = Field(default_factory=AsrSlaConfig)

    @field_validator("metric")
    @classmethod
    def _llm_metric(cls, value: str) -> str:
        # The wider literal is the wire's (SlaSpec); what the LLM controller measures is narrower.
        problem = sla_metric_problem("llm", value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _llm_preset_metric(self) -> SlaConfig:
        self._check_preset_metric("llm", self.metric)
        return self
