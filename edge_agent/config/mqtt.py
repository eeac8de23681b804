"""``[mqtt]`` and ``[telemetry]``: the broker link, the telemetry spool and ledger, and what the fleet may command."""

from __future__ import annotations

import re
import socket
import typing
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from ..errors import ConfigError, EdgeAgentError
from ..fleet_keys import load_public_key
from .base import Section, user_dir


class TlsConfig(Section):
    """``[mqtt.tls]``: the CA to trust and, for mutual TLS, the client certificate and key."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _cert_needs_key(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (mutual TLS needs both)")
        return self


def _default_device_id() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "edge-device"


class MqttConfig(Section):
    """``[mqtt]``: the broker, the device id, credentials and the link's timing."""

    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    device_id: str = Field(default_factory=_default_device_id)
    username: str | None = None
    password: SecretStr | None = None
    tls: TlsConfig | None = None
    keepalive_s: int = Field(20, ge=5, le=600)
    topic_prefix: str = "edge/v1"
    reconnect_max_s: float = Field(30.0, ge=1, le=3600, description="longest jittered wait between reconnects")
    max_inflight: int = Field(20, ge=1, le=1000, description="unacknowledged QoS 1 messages at a time")
    homeassistant_discovery: bool = Field(
        False,
        description="publish Home Assistant MQTT discovery (retained): latency, tokens/s, temperature and "
        "tier sensors, and a tier select; turned off, the next start clears what was published",
    )
    homeassistant_prefix: str = Field(
        "homeassistant",
        pattern=r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*$",
        max_length=128,
        description="Home Assistant's discovery prefix",
    )

    @field_validator("device_id")
    @classmethod
    def _topic_safe(cls, value: str) -> str:
        if not value or any(c in value for c in "+#/") or not value.isprintable():
            raise ValueError("must be non-empty, printable and free of '+', '#' and '/' (it is a topic level)")
        return value


# Commands a fleet may send (``telemetry/command_args.py`` ALLOWED); ``telemetry.commands_allowed`` narrows them.
FleetCommand = Literal[
    "get_status", "set_sla", "pin_tier", "unpin_tier", "rebuild_engine", "flush_telemetry", "reset_desired"
]
FLEET_COMMANDS: tuple[FleetCommand, ...] = typing.get_args(FleetCommand)


# The default of ``telemetry.max_signature_lifetime_s`` (one day), also ``signing.Verifier``'s.
MAX_SIGNATURE_LIFETIME_S = 86_400.0


class TelemetryConfig(Section):
    """``[telemetry]``: the window interval, the spool and the ledger, and what the fleet may command."""

    interval_s: float = Field(10.0, gt=0, le=3600)
    spool_path: Path = Field(default_factory=lambda: user_dir("state") / "spool.sqlite")
    spool_max_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    spool_max_records: int = Field(100_000, ge=10)
    replay_per_s: float = Field(5.0, gt=0, le=10_000, description="backlog replay rate after an outage")
    ledger_path: Path = Field(default_factory=lambda: user_dir("state") / "commands.sqlite")
    max_command_bytes: int = Field(16 * 1024, ge=256, le=1024 * 1024)
    commands_allowed: list[FleetCommand] = Field(
        default_factory=lambda: list(FLEET_COMMANDS), description="fleet commands this device runs; [] = none"
    )
    reply_prefixes: list[str] = Field(
        default_factory=lambda: ["fleet/replies/"],
        description="topic prefixes (besides the device's own "
        "<prefix>/<device_id>/cmd/<name>/res and .../res/) that command replies may be sent under",
    )
    fleet_public_key: str | None = Field(
        None,
        description="the fleet's Ed25519 public key (a PEM file or the raw key in base64): when set, "
        "commands and desired must be signed with it (docs/telemetry.md 'Signed commands')",
    )
    max_signature_lifetime_s: float = Field(
        MAX_SIGNATURE_LIFETIME_S,
        gt=0,
        le=366 * 86_400,
        description="the furthest ahead a signed command or desired may expire (device time, plus 5 minutes "
        "for clock difference); anything signed for longer is refused, so a leaked one cannot be replayed for ever",
    )

    @field_validator("reply_prefixes")
    @classmethod
    def _concrete_prefixes(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not p.endswith("/") or len(p) < 2 or any(c in p for c in "+#\0")]
        if bad:
            raise ValueError(f"each prefix must end with '/' and have no '+', '#' or NUL: {bad}")
        return value

    @field_validator("fleet_public_key")
    @classmethod
    def _loadable_key(cls, value: str | None) -> str | None:
        if value:  # a key that cannot be read must stop the agent, never fall back to unsigned
            try:
                load_public_key(value)
            except ConfigError as exc:
                raise ValueError("; ".join(msg for _path, msg in exc.problems)) from None
            except EdgeAgentError as exc:
                raise ValueError(str(exc)) from None
        return value
