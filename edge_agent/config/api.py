"""``[api]``: where the local OpenAI-compatible API listens, how a client authenticates, and which web
origins may call it from a browser (CORS)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator

from .base import Section


class ApiConfig(Section):
    """``[api]``: where the local API listens, how a client authenticates, which origins may call it."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    unix_socket: Path | None = None
    token: SecretStr | None = None
    allow_unauthenticated: bool = Field(
        False,
        description="serve a host other machines can reach without a "
        "token (the agent then warns at start); off: such a config is refused",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="web origins (scheme://host[:port]) whose pages may call the API from a browser, "
        'like Ollama\'s OLLAMA_ORIGINS; ["*"] allows any; empty: no CORS headers at all',
    )

    @field_validator("cors_origins")
    @classmethod
    def _origins_are_origins(cls, value: list[str]) -> list[str]:
        # A browser sends Origin as scheme://host[:port] exactly: anything else would never match.
        for origin in value:
            if origin == "*":
                continue
            scheme, sep, rest = origin.partition("://")
            if not sep or not scheme or not rest or "/" in rest or origin != origin.strip():
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port] with no path or trailing "
                    'slash (e.g. "http://localhost:3000"), or "*" for any'
                )
        return value

    @field_validator("token")
    @classmethod
    def _token_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty token used to switch authentication off without a word.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is empty: set a secret, or remove the key to serve without one (loopback only)")
        return value

    @model_validator(mode="after")
    def _open_host_needs_token(self) -> ApiConfig:
        if (
            self.unix_socket is None
            and self.token is None
            and not self.allow_unauthenticated
            and not self.is_loopback(self.host)
        ):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and no token is set: set "
                "api.token (clients send Authorization: Bearer …), keep host on loopback, or set "
                "api.allow_unauthenticated = true to serve it open on purpose"
            )
        return self

    @staticmethod
    def is_loopback(host: str) -> bool:
        """Whether ``host`` only listens on this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
        import ipaddress

        if host.strip().lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
            return True
        try:
            return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
        except ValueError:  # a name other than localhost, or "" (every interface)
            return False
