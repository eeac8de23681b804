"""Signed fleet messages: an Ed25519 envelope around a command or ``desired`` payload.

The fleet holds a private key; each device holds the fleet's public key
(``telemetry.fleet_public_key``: a PEM file, or the raw 32-byte key in base64). With it set, a
device runs only commands and ``desired`` documents whose envelope verifies and has not expired:

    {"schema": "edge-agent.signed/1", "expires": <unix seconds>,
     "payload": "<base64 of the exact request bytes>", "sig": "<base64 Ed25519 signature>"}

    signature over:  topic (UTF-8) + b"\\n" + str(expires) + b"\\n" + payload bytes

The topic is signed, so a message for one device (or one command) is worthless on another; the
expiry bounds replay (and the ``cmd_id`` ledger makes a replayed command a duplicate). A JSON
envelope rather than MQTT user properties: it survives MQTT 3.1.1 bridges and retained storage.

``cryptography`` is imported lazily: only devices and tools that use signing need the ``fleet`` extra.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, EdgeAgentError

if TYPE_CHECKING:  # pragma: no cover
    from ..config import MqttConfig, TelemetryConfig

ENVELOPE = "edge-agent.signed/1"
INSTALL_HINT = "pip install 'edge-agent[fleet]'"


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise EdgeAgentError(f"signed fleet messages need the 'cryptography' package: {INSTALL_HINT}") from exc
    return serialization, ed25519


def signed_bytes(topic: str, expires: int, payload: bytes) -> bytes:
    return topic.encode() + b"\n" + str(int(expires)).encode() + b"\n" + payload


# -- keys -------------------------------------------------------------------------------------------

def load_public_key(value: str, where: str = "telemetry.fleet_public_key") -> Any:
    """An Ed25519 public key from a PEM file path or the raw 32-byte key in base64."""
    serialization, ed25519 = _crypto()
    text = value.strip()
    raw = _b64(text)
    if raw is not None and len(raw) == 32:
        return ed25519.Ed25519PublicKey.from_public_bytes(raw)
    path = Path(text).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([(where, f"neither a base64 Ed25519 key (32 bytes) nor a readable PEM file: "
                                   f"{path}: {exc.strerror or exc}")]) from None
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
    return base64.b64encode(public_key.public_bytes(serialization.Encoding.Raw,
                                                    serialization.PublicFormat.Raw)).decode()


def keygen(out: Path) -> tuple[Path, str]:
    """Write a new private key (PEM, mode 0600) and ``<out>.pub.pem``; return the public PEM path and
    the public key in base64 (either form works as ``telemetry.fleet_public_key``)."""
    serialization, ed25519 = _crypto()
    out = Path(out)
    if out.exists():
        raise EdgeAgentError(f"{out} exists; refusing to overwrite a key")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub = out.with_name(out.name.removesuffix(".pem") + ".pub.pem")
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return pub, public_key_b64(key.public_key())


# -- envelopes --------------------------------------------------------------------------------------

def sign(private_key: Any, topic: str, payload: bytes, expires: int) -> bytes:
    """The envelope to publish on ``topic`` (as the MQTT payload)."""
    sig = private_key.sign(signed_bytes(topic, expires, payload))
    return json.dumps({"schema": ENVELOPE, "expires": int(expires),
                       "payload": base64.b64encode(payload).decode(),
                       "sig": base64.b64encode(sig).decode()}).encode()


class Unsigned(Exception):
    """A message refused by the signature check; the message is the reason sent back."""


def unwrap(payload: bytes) -> tuple[bytes, int, bytes] | None:
    """``(inner payload, expires, signature)`` when ``payload`` is an envelope, else None.
    Raises ``Unsigned`` for an envelope that is malformed."""
    if payload.lstrip()[:1] != b"{":
        return None
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != ENVELOPE:
        return None
    extra = sorted(set(doc) - {"schema", "expires", "payload", "sig"})
    expires, inner, sig = doc.get("expires"), doc.get("payload"), doc.get("sig")
    if extra or not isinstance(expires, int) or isinstance(expires, bool) or not isinstance(inner, str) \
            or not isinstance(sig, str):
        raise Unsigned(f"malformed {ENVELOPE} envelope: needs integer 'expires' and base64 'payload' and "
                       f"'sig'{'; unknown keys ' + ', '.join(extra) if extra else ''}")
    raw, signature = _b64(inner), _b64(sig)
    if raw is None or signature is None:
        raise Unsigned(f"malformed {ENVELOPE} envelope: 'payload' and 'sig' must be base64")
    return raw, expires, signature


class Verifier:
    """Checks envelopes against the fleet's public key (None: envelopes are unwrapped, not checked)."""

    def __init__(self, public_key: Any | None, wall: Callable[[], float] = time.time) -> None:
        self.public_key, self.wall = public_key, wall

    @property
    def required(self) -> bool:
        return self.public_key is not None

    def open(self, topic: str, payload: bytes) -> bytes:
        """The payload to act on, or ``Unsigned`` with the reason."""
        env = unwrap(payload)
        if env is None:
            if self.required:
                raise Unsigned("unsigned: this device accepts only messages signed with the fleet key "
                               "(telemetry.fleet_public_key); see 'Signed commands' in docs/telemetry.md")
            return payload
        inner, expires, signature = env
        now = self.wall()
        if expires < now:
            raise Unsigned(f"signature expired {now - expires:.0f} s ago (expires {expires}, device time {now:.0f})")
        if self.public_key is not None:  # required
            from cryptography.exceptions import InvalidSignature

            try:
                self.public_key.verify(signature, signed_bytes(topic, expires, inner))
            except InvalidSignature:
                raise Unsigned(f"bad signature: not signed with the configured fleet key for topic {topic}") from None
        return inner


# -- the open-channel warning -------------------------------------------------------------------------

def command_channel_warnings(mqtt: MqttConfig, telemetry: TelemetryConfig) -> list[str]:
    """Why anyone on the broker could steer this device, or [] when that is not so."""
    if telemetry.fleet_public_key:
        return []
    anonymous = not mqtt.username and not (mqtt.tls and mqtt.tls.cert_file)
    if not (anonymous or mqtt.tls is None):
        return []
    how = " and ".join(w for w, on in (("anonymously (no username, no client certificate)", anonymous),
                                       ("without TLS", mqtt.tls is None)) if on)
    what = (f"commands ({', '.join(telemetry.commands_allowed)}) and desired" if telemetry.commands_allowed
            else "desired")
    return [f"command channel open: {what} are accepted unsigned from any client of the broker "
            f"{mqtt.host}:{mqtt.port}, reached {how}; set telemetry.fleet_public_key (signed commands), "
            "use TLS and credentials with a broker ACL, or narrow telemetry.commands_allowed"]


# -- CLI (``edge-agent fleet keygen`` / ``fleet sign``; registered by fleet.py) ----------------------------

def add_cli(fsub: Any) -> None:
    k = fsub.add_parser("keygen", help="create the fleet's Ed25519 signing key (devices get the public half)",
                        description="Write a private key (PEM, mode 0600) and <name>.pub.pem; print the public "
                                    "key in base64. Either form is a device's telemetry.fleet_public_key.")
    k.add_argument("--out", required=True, metavar="KEY.pem", help="private key file to create")
    k.set_defaults(func=cmd_keygen)
    s = fsub.add_parser("sign", help="wrap a command or desired payload in a signed envelope (printed on stdout)",
                        description="Print the signed envelope to publish on TOPIC, e.g. "
                                    "edge-agent fleet sign --key fleet.pem --topic edge/v1/dev-17/cmd/get_status/req "
                                    "--payload-file req.json | mosquitto_pub -V mqttv5 -t TOPIC -s")
    s.add_argument("--key", required=True, metavar="KEY.pem", help="the fleet's private key (from fleet keygen)")
    s.add_argument("--topic", required=True, help="the exact topic it will be published on")
    s.add_argument("--payload-file", required=True, metavar="FILE", help="the request or desired JSON ('-' = stdin)")
    s.add_argument("--ttl", type=int, default=300, metavar="S",
                   help="seconds until the signature expires (default 300; sign a retained desired for as long "
                        "as it should stay valid, e.g. 2592000 for 30 days)")
    s.set_defaults(func=cmd_sign)


def cmd_keygen(args: Any) -> int:
    pub, b64 = keygen(Path(args.out))
    print(f"private key: {args.out} (keep it with the fleet manager, mode 0600)")
    print(f"public key:  {pub}")
    print(f"telemetry.fleet_public_key = \"{b64}\"   (or the path of {pub.name} on the device)")
    return 0


def cmd_sign(args: Any) -> int:
    import sys

    if args.ttl <= 0:
        raise EdgeAgentError(f"--ttl must be positive, got {args.ttl}")
    if any(c in args.topic for c in "+#\0") or not args.topic:
        raise EdgeAgentError(f"--topic must be one concrete topic (no wildcards), got {args.topic!r}")
    key = load_private_key(Path(args.key))
    try:
        payload = sys.stdin.buffer.read() if args.payload_file == "-" else Path(args.payload_file).read_bytes()
    except OSError as exc:
        raise EdgeAgentError(f"cannot read {args.payload_file}: {exc.strerror or exc}") from None
    sys.stdout.buffer.write(sign(key, args.topic, payload, int(time.time()) + args.ttl) + b"\n")
    return 0


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
