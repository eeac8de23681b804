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
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.mqtt import MAX_SIGNATURE_LIFETIME_S
from ..errors import EdgeAgentError
from ..fleet_keys import b64_or_none, keygen, load_private_key

# the keys moved to fleet_keys; these stay importable from here
from ..fleet_keys import load_public_key as load_public_key
from ..fleet_keys import public_key_b64 as public_key_b64

if TYPE_CHECKING:  # pragma: no cover
    from ..config import MqttConfig, TelemetryConfig

ENVELOPE = "edge-agent.signed/1"
# Allowed on top of ``telemetry.max_signature_lifetime_s``: a fleet that signs for exactly the devices'
# limit is not refused because a device's clock runs a little behind the fleet's.
CLOCK_SKEW_S = 300.0


def signed_bytes(topic: str, expires: int, payload: bytes) -> bytes:
    return topic.encode() + b"\n" + str(int(expires)).encode() + b"\n" + payload


# -- envelopes --------------------------------------------------------------------------------------


def sign(private_key: Any, topic: str, payload: bytes, expires: int) -> bytes:
    """The envelope to publish on ``topic`` (as the MQTT payload)."""
    sig = private_key.sign(signed_bytes(topic, expires, payload))
    return json.dumps(
        {
            "schema": ENVELOPE,
            "expires": int(expires),
            "payload": base64.b64encode(payload).decode(),
            "sig": base64.b64encode(sig).decode(),
        }
    ).encode()


class Unsigned(Exception):
    """A message refused by the signature check; the message is the reason sent back."""


class Malformed(Unsigned):
    """An envelope that cannot be read (a field missing, of the wrong type or out of range): refused
    like any unsigned message, and counted apart (``malformed_envelope``) since it is junk, not a
    forgery to investigate."""


# ``expires`` is unix seconds in a signed 64-bit integer, as every fleet tool writes it; anything
# outside is no time at all, and a bounded integer keeps every later comparison and subtraction exact.
MAX_EXPIRES = 2**63 - 1


def _shape(value: Any) -> str:
    """What a field held, for a refusal's reason: short whatever its size (a reason is echoed and logged)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):  # json.loads reads at most 4300 digits, so str() is safe
        return str(value) if abs(value) < 10**20 else f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return f"a JSON {'object' if isinstance(value, dict) else 'array'}"


def unwrap(payload: bytes) -> tuple[bytes, int, bytes] | None:
    """``(inner payload, expires, signature)`` when ``payload`` is an envelope, else None (not JSON,
    nested too deeply to read, or without the envelope's ``schema``). Raises ``Malformed`` for an
    envelope that is malformed, and nothing else whatever the bytes."""
    if payload.lstrip()[:1] != b"{":
        return None
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):  # ValueError: also an integer of > 4300 digits
        return None
    if not isinstance(doc, dict) or doc.get("schema") != ENVELOPE:
        return None
    extra = sorted(set(doc) - {"schema", "expires", "payload", "sig"})
    if extra:
        named = ", ".join(repr(k[:40]) for k in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise Malformed(f"malformed envelope ({ENVELOPE}): unknown keys {named}")
    missing = [k for k in ("expires", "payload", "sig") if k not in doc]
    if missing:
        raise Malformed(f"malformed envelope ({ENVELOPE}): missing {', '.join(missing)}")
    expires, inner, sig = doc["expires"], doc["payload"], doc["sig"]
    if not isinstance(expires, int) or isinstance(expires, bool) or not 0 <= expires <= MAX_EXPIRES:
        raise Malformed(
            f"malformed envelope ({ENVELOPE}): 'expires' must be an integer of unix seconds from 0 to 2^63-1, "
            f"got {_shape(expires)}"
        )
    bad = [f"'{k}' is {_shape(v)}" for k, v in (("payload", inner), ("sig", sig)) if not isinstance(v, str)]
    if bad:
        raise Malformed(
            f"malformed envelope ({ENVELOPE}): 'payload' and 'sig' must be base64 strings; {'; '.join(bad)}"
        )
    raw, signature = b64_or_none(inner), b64_or_none(sig)
    if raw is None or signature is None:
        raise Malformed(f"malformed envelope ({ENVELOPE}): 'payload' and 'sig' must be base64")
    return raw, expires, signature


class Verifier:
    """Checks envelopes against the fleet's public key (None: envelopes are unwrapped, not checked),
    and their expiry against the device's clock: not past, and not further ahead than
    ``max_lifetime_s`` (``telemetry.max_signature_lifetime_s``) plus ``CLOCK_SKEW_S``, so that a
    leaked signed message stops working within that time, whatever expiry it was signed with.

    Guarantee: ``open`` returns the payload to act on or raises ``Unsigned`` (``Malformed`` for an
    envelope it cannot read) with the reason; no other exception, whatever the bytes."""

    def __init__(
        self,
        public_key: Any | None,
        wall: Callable[[], float] = time.time,
        max_lifetime_s: float = MAX_SIGNATURE_LIFETIME_S,
    ) -> None:
        self.public_key, self.wall, self.max_lifetime_s = public_key, wall, max_lifetime_s

    @property
    def required(self) -> bool:
        return self.public_key is not None

    def open(self, topic: str, payload: bytes) -> bytes:
        """The payload to act on, or ``Unsigned`` with the reason (see the class doc)."""
        try:
            env = unwrap(payload)
        except Unsigned:
            raise
        except Exception as exc:  # the promise above; unwrap's own checks should leave nothing to land here
            raise Malformed(f"malformed envelope ({ENVELOPE}): unreadable ({type(exc).__name__})") from None
        if env is None:
            if self.required:
                raise Unsigned(
                    "unsigned: this device accepts only messages signed with the fleet key "
                    "(telemetry.fleet_public_key); see 'Signed commands' in docs/telemetry.md"
                )
            return payload
        inner, expires, signature = env
        now = self.wall()
        if expires < now:
            raise Unsigned(f"signature expired {now - expires:.0f} s ago (expires {expires}, device time {now:.0f})")
        if expires > now + self.max_lifetime_s + CLOCK_SKEW_S:  # unwrap bounds expires: nothing overflows
            raise Unsigned(
                f"signature valid for too long: expires {expires}, {expires - now:.0f} s after device time "
                f"{now:.0f}; this device takes at most telemetry.max_signature_lifetime_s = "
                f"{self.max_lifetime_s:.0f} s (plus {CLOCK_SKEW_S:.0f} s for clock difference)"
            )
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
    how = " and ".join(
        w
        for w, on in (
            ("anonymously (no username, no client certificate)", anonymous),
            ("without TLS", mqtt.tls is None),
        )
        if on
    )
    what = (
        f"commands ({', '.join(telemetry.commands_allowed)}) and desired" if telemetry.commands_allowed else "desired"
    )
    return [
        f"command channel open: {what} are accepted unsigned from any client of the broker "
        f"{mqtt.host}:{mqtt.port}, reached {how}; set telemetry.fleet_public_key (signed commands), "
        "use TLS and credentials with a broker ACL, or narrow telemetry.commands_allowed"
    ]


# -- CLI (``edge-agent fleet keygen`` / ``fleet sign``; registered by fleet.py) ----------------------------


def add_cli(fsub: Any) -> None:
    k = fsub.add_parser(
        "keygen",
        help="create the fleet's Ed25519 signing key (devices get the public half)",
        description="Write a private key (PEM, mode 0600) and <name>.pub.pem; print the public "
        "key in base64. Either form is a device's telemetry.fleet_public_key.",
    )
    k.add_argument("--out", required=True, metavar="KEY.pem", help="private key file to create")
    k.set_defaults(func=cmd_keygen)
    s = fsub.add_parser(
        "sign",
        help="wrap a command or desired payload in a signed envelope (printed on stdout)",
        description="Print the signed envelope to publish on TOPIC, e.g. "
        "edge-agent fleet sign --key fleet.pem --topic edge/v1/dev-17/cmd/get_status/req "
        "--payload-file req.json | mosquitto_pub -V mqttv5 -t TOPIC -s",
    )
    s.add_argument("--key", required=True, metavar="KEY.pem", help="the fleet's private key (from fleet keygen)")
    s.add_argument("--topic", required=True, help="the exact topic it will be published on")
    s.add_argument("--payload-file", required=True, metavar="FILE", help="the request or desired JSON ('-' = stdin)")
    s.add_argument(
        "--ttl",
        type=int,
        default=300,
        metavar="S",
        help="seconds until the signature expires (default 300); devices refuse more than their "
        "telemetry.max_signature_lifetime_s (default 86400, one day): re-sign a retained desired before it expires",
    )
    s.set_defaults(func=cmd_sign)


def cmd_keygen(args: Any) -> int:
    pub, b64 = keygen(Path(args.out))
    print(f"private key: {args.out} (keep it with the fleet manager, mode 0600)")
    print(f"public key:  {pub}")
    print(f'telemetry.fleet_public_key = "{b64}"   (or the path of {pub.name} on the device)')
    return 0


def cmd_sign(args: Any) -> int:
    import sys

    if args.ttl <= 0:
        raise EdgeAgentError(f"--ttl must be positive, got {args.ttl}")
    if args.ttl > MAX_SIGNATURE_LIFETIME_S + CLOCK_SKEW_S:  # signed all the same: a device may allow more
        print(
            f"warning: devices with the default telemetry.max_signature_lifetime_s ({MAX_SIGNATURE_LIFETIME_S:.0f} s) "
            f"refuse a signature valid for {args.ttl} s",
            file=sys.stderr,
        )
    if any(c in args.topic for c in "+#\0") or not args.topic:
        raise EdgeAgentError(f"--topic must be one concrete topic (no wildcards), got {args.topic!r}")
    key = load_private_key(Path(args.key))
    try:
        payload = sys.stdin.buffer.read() if args.payload_file == "-" else Path(args.payload_file).read_bytes()
    except OSError as exc:
        raise EdgeAgentError(f"cannot read {args.payload_file}: {exc.strerror or exc}") from None
    sys.stdout.buffer.write(sign(key, args.topic, payload, int(time.time()) + args.ttl) + b"\n")
    return 0
