"""``[wyoming]``: the Wyoming protocol server Home Assistant's voice pipeline talks to (docs/wyoming.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from .api import ApiConfig
from .base import Section


class WyomingConfig(Section):
    """``[wyoming]``: speech-to-text (the ASR tiers) and a conversation agent (the LLM) over Wyoming."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(10300, ge=0, le=65535, description="10300: the port Home Assistant's Wyoming docs use")
    allow_remote: bool = Field(
        False,
        description="serve a host other machines can reach; the Wyoming protocol has no authentication, so "
        "anything on the network may then use the models: off, such a host is refused",
    )
    announce: bool = Field(False, description="announce the server over zeroconf (_wyoming._tcp), needs 'zeroconf'")
    name: str = Field("edge-agent", min_length=1, max_length=63, description="the program and zeroconf name")
    handle: bool = Field(True, description="offer the LLM as a conversation agent (transcript -> handled)")
    max_reply_tokens: int = Field(256, ge=1, le=1024)
    system_prompt: str = Field(
        "",
        description="what the conversation agent's replies start from; empty: none",
    )
    max_connections: int = Field(32, ge=1, le=1024, description="more are closed at once, each with a log line")
    idle_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a connection that sends nothing this long is closed"
    )
    max_audio_s: float = Field(120.0, gt=0, le=3600, description="longer audio in one request closes the connection")

    @model_validator(mode="after")
    def _remote_needs_consent(self) -> WyomingConfig:
        if self.enabled and not self.allow_remote and not ApiConfig.is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and the Wyoming protocol has no "
                "authentication: keep host on loopback, or set wyoming.allow_remote = true to serve it on purpose "
                "(Home Assistant on another machine needs that)"
            )
        return self
