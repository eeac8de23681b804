"""What the fleet may ask a device: the ``CommandTarget`` seam the agent implements, the allowed
commands with the shape of their arguments (``ALLOWED``, strict pydantic models: no extra keys,
names and workloads by pattern), and how a refusal reads (``Rejected``, ``describe``). Used by
``remote_commands`` (one request at a time) and ``desired`` (the overlay applies the same calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .schema import NAME, WORKLOAD, SlaSpec


class CommandTarget(Protocol):
    """What the agent implements so the fleet can steer it. Methods return a JSON-able result dict
    and raise (preferably ``EdgeAgentError``) to fail the command with that message."""

    def tiers(self) -> Mapping[str, Sequence[str]]: ...  # workload -> configured tier names
    def recipes(self) -> Sequence[str]: ...  # configured engine recipe names
    def status(self) -> dict[str, Any]: ...
    # ``source`` says who asked, for ``reported.sources``: "command" or "desired@<version>".
    def set_sla(self, workload: str, sla: SlaSpec, source: str = "command") -> dict[str, Any]: ...
    def pin_tier(self, workload: str, tier: str, source: str = "command") -> dict[str, Any]: ...
    def unpin_tier(self, workload: str, source: str = "command") -> dict[str, Any]: ...
    def reload(self) -> str: ...  # re-read the config file, then ``reapply_desired`` on top
    def rebuild_engine(self, recipe: str) -> dict[str, Any]: ...
    def flush_telemetry(self) -> dict[str, Any]: ...
    def reported(self) -> dict[str, Any]: ...  # active_tiers, pins, sla, engine_hashes


class CommandArgs(BaseModel):
    """The arguments of one command: strict (no extra keys), immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoArgs(CommandArgs):
    """A command without arguments."""


class SetSlaArgs(CommandArgs):
    """``set_sla``: a workload's SLA."""

    workload: str = Field(pattern=WORKLOAD)
    sla: SlaSpec


class PinTierArgs(CommandArgs):
    """``pin_tier``: a workload and one of its configured tiers."""

    workload: str = Field(pattern=WORKLOAD)
    tier: str = Field(pattern=NAME)


class WorkloadArgs(CommandArgs):
    """``unpin_tier``: a workload."""

    workload: str = Field(pattern=WORKLOAD)


class RebuildArgs(CommandArgs):
    """``rebuild_engine``: one of the configured engine recipes."""

    recipe: str = Field(pattern=NAME)


ALLOWED: dict[str, type[CommandArgs]] = {
    "get_status": NoArgs,
    "set_sla": SetSlaArgs,
    "pin_tier": PinTierArgs,
    "unpin_tier": WorkloadArgs,
    "rebuild_engine": RebuildArgs,
    "flush_telemetry": NoArgs,
    "reset_desired": NoArgs,
}


class Rejected(Exception):
    """A request refused before execution; the message is the ``reason`` sent back."""


def describe(exc: ValidationError, prefix: str = "") -> str:
    """A pydantic error as one line a fleet operator can act on: at most five ``field: problem``."""
    parts = []
    for err in exc.errors()[:5]:
        loc = prefix + ".".join(str(p) for p in err["loc"]) if err["loc"] else "(payload)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
