"""The base of every MQTT payload model: ``Wire``, the ``schema`` field, and the shared name patterns.

The payload models themselves live by topic in ``wire_latency`` (``tele/latency``), ``wire_device``
(state, meta, inventory, reported, desired) and ``wire_events`` (events, commands);
``edge_agent.telemetry.schema`` re-exports them all and generates the JSON Schema files.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


def schema_field(name: str) -> Any:
    sid = schema_id(name)
    return Field(
        sid, alias="schema", pattern=f"^{sid.replace('.', '[.]')}$", description="payload name and major version"
    )
