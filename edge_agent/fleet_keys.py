"""The fleet's Ed25519 keys: a device's public key (``telemetry.fleet_public_key``: a PEM file, or the
raw 32-byte key in base64) and the fleet manager's private key and key pair.

Kept apart from ``telemetry.signing`` (the envelopes) so that the configuration can check a key
while it loads without depending on the telemetry package. ``cryptography`` is imported lazily:
only devices and tools that use signing need the ``fleet`` extra.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError, EdgeAgentError

INSTALL_HINT = "pip install 'edge-agent[fleet]'"


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise EdgeAgentError(f"signed fleet messages need the 'cryptography' package: {INSTALL_HINT}") from exc
    return serialization, ed25519


def load_public_key(value: str, where: str = "telemetry.fleet_public_key") -> Any:
    """An Ed25519 public key from a PEM file path or the raw 32-byte key in base64."""
    serialization, ed25519 = _crypto()
    text = value.strip()
    raw = b64_or_none(text)
    if raw is not None and len(raw) == 32:
        return ed25519.Ed25519PublicKey.from_public_bytes(raw)
    path = Path(text).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            [(where, f"neither a base64 Ed25519 key (32 bytes) nor a readable PEM file: {path}: {exc.strerror or exc}")]
        ) from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise ConfigError([(where, f"{path}: not a PEM public key: {exc}")]) from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError([(where, f"{path}: a {type(key).__name__}, not an Ed25519 public key")])
    return key


def load_private_key(path: Path) -> Any:
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise EdgeAgentError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:
        raise EdgeAgentError(f"{path}: not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise EdgeAgentError(f"{path}: a {type(key).__name__}, not an Ed25519 private key")
    return key


def public_key_b64(public_key: Any) -> str:
    serialization, _ = _crypto()
    return base64.b64encode(
        public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()


def keygen(out: Path) -> tuple[Path, str]:
    """Write a new private key (PEM, mode 0600) and ``<out>.pub.pem``; return the public PEM path and
    the public key in base64 (either form works as ``telemetry.fleet_public_key``)."""
    serialization, ed25519 = _crypto()
    out = Path(out)
    if out.exists():
        raise EdgeAgentError(f"{out} exists; refusing to overwrite a key")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub = out.with_name(out.name.removesuffix(".pem") + ".pub.pem")
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pub, public_key_b64(key.public_key())


def b64_or_none(text: str) -> bytes | None:
    """Strict base64 decoding; None for text that is not base64."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
