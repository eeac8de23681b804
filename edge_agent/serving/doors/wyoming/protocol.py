"""The Wyoming wire format read with bounds: JSON header lines, additional data and payloads of limited size.

Events are the ``wyoming`` library's (``wyoming.event.Event``); reading is done here rather than with
its ``async_read_event`` so that no client can make the server buffer an unbounded line, data block or
payload, or wait forever for one (``read_event``'s ``ProtocolError`` says which bound was broken). JSON
nested deeper than the parser follows is refused like any other bad JSON, and the fields of the events the
server acts on are checked before they are used (``check_fields``: a missing or mistyped one is a
``ProtocolError`` naming the event, the field, its value and what is allowed). A client's strings in a
message are clipped (``clip``) so that no log line carries more than a few hundred characters of them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ....errors import EdgeAgentError

MAX_LINE = 64 * 1024  # one event's JSON header line
MAX_DATA = 64 * 1024  # its additional data (data_length)
MAX_PAYLOAD = 1 << 20  # its binary payload (payload_length): 32 s of 16 kHz PCM16
WRITE_TIMEOUT_S = 10.0
CLIP = 60  # characters of a client's string kept in a message

# What the server reads of the events it acts on: field -> (allowed types, required, what is allowed in words)
_INT = ((int,), True, "an integer")
_OPT_INT = ((int, type(None)), False, "an integer or null")
_OPT_STR = ((str, type(None)), False, "a string or null")
_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool, str]]] = {
    "audio-start": {"rate": _INT, "width": _INT, "channels": _INT, "timestamp": _OPT_INT},
    "audio-stop": {"timestamp": _OPT_INT},
    "transcript": {"text": ((str,), True, "a string")},
    "transcribe": {"name": _OPT_STR, "language": _OPT_STR},
}
_FIELDS["audio-chunk"] = _FIELDS["audio-start"]


class ProtocolError(Exception):
    """What a client sent breaks the protocol or the server's bounds; its connection is closed."""


def clip(value: object, limit: int = CLIP) -> str:
    """``repr(value)`` cut to about ``limit`` characters, saying how long it was: a client's string in a log line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, (str, bytes)) else f"{len(text):,} characters"
    return f"{text[:limit]}… ({size})"


def check_fields(kind: str, data: dict) -> None:
    """Every field the server reads of a ``kind`` event is there and of its kind, else a ``ProtocolError``."""
    for name, (kinds, required, allowed) in _FIELDS.get(kind, {}).items():
        if name not in data:
            if required:
                raise ProtocolError(f"{kind}: {name!r} is missing; it must be {allowed}")
            continue
        value = data[name]
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise ProtocolError(f"{kind}: {name!r} is {clip(value)}; it must be {allowed}")


def wyoming_events() -> Any:
    try:
        import wyoming.event
    except ImportError as exc:  # a core dependency; only a broken install gets here
        raise EdgeAgentError("the Wyoming server needs the 'wyoming' package: pip install wyoming") from exc
    return wyoming.event


async def read_event(reader: asyncio.StreamReader, idle_s: float) -> Any:
    """The next event, or None at a clean end of the connection; ``ProtocolError`` for anything else."""
    event_mod = wyoming_events()
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), idle_s)
    except asyncio.TimeoutError as exc:
        raise ProtocolError(f"nothing received for {idle_s:g} s") from exc
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise ProtocolError("the connection closed in the middle of an event") from exc
        return None
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError(f"an event header longer than {MAX_LINE} bytes") from exc
    except ConnectionError:
        return None
    try:
        header = json.loads(line)
    except RecursionError as exc:
        raise ProtocolError("an event header of JSON nested deeper than the server reads") from exc
    except ValueError as exc:
        raise ProtocolError(f"not a Wyoming event (not a JSON line): {line[:40]!r}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError(f"not a Wyoming event (no 'type'): {line[:40]!r}")
    kind = header["type"]
    said = clip(kind)
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise ProtocolError(f"{said}: 'data' is not an object")
    data_len, payload_len = header.get("data_length") or 0, header.get("payload_length") or 0
    for name, value, limit in (("data_length", data_len, MAX_DATA), ("payload_length", payload_len, MAX_PAYLOAD)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise ProtocolError(f"{said}: {name} {clip(value)} is outside 0..{limit}")
    try:
        if data_len:
            extra = json.loads(await asyncio.wait_for(reader.readexactly(data_len), idle_s))
            if not isinstance(extra, dict):
                raise ProtocolError(f"{said}: its data is not a JSON object")
            data.update(extra)
        payload = await asyncio.wait_for(reader.readexactly(payload_len), idle_s) if payload_len else None
    except asyncio.TimeoutError as exc:
        raise ProtocolError(f"{said}: its data did not arrive within {idle_s:g} s") from exc
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"{said}: the connection closed before its data") from exc
    except RecursionError as exc:
        raise ProtocolError(f"{said}: its data is JSON nested deeper than the server reads") from exc
    except ValueError as exc:
        raise ProtocolError(f"{said}: its data is not JSON") from exc
    check_fields(kind, data)
    return event_mod.Event(type=kind, data=data, payload=payload)
