"""Wire models of ``evt/<type>`` events (with a ``spool_drop``'s data) and of ``cmd/<name>`` requests and
responses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .wire import NAME, UINT64_MAX, WORKLOAD, Wire, schema_field


class Event(Wire):
    """``evt/<type>``: something happened (tier_switch, spool_drop, clock_jump, ...)."""

    schema_: str = schema_field("event")
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

    schema_: str = schema_field("cmd.request")
    cmd_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
    args: dict[str, Any] = Field(default_factory=dict)
    expires_at_wall: float | None = Field(None, description="unix time after which the device must not run it")


class CommandResponse(Wire):
    """``cmd/<name>/res`` (or the request's response topic); one message per status change."""

    schema_: str = schema_field("cmd.response")
    device_id: str = Field(pattern=NAME)
    cmd_id: str | None = Field(None, max_length=64, description="null when the request was too malformed to read one")
    command: str = Field(max_length=64)
    status: Literal["accepted", "executing", "succeeded", "failed", "expired", "rejected"]
    reason: str | None = Field(None, max_length=1024)
    result: dict[str, Any] | None = None
    duplicate: bool = False
    at_wall: float
