"""What keeps the local API's socket layer safe from slow, huge or stray clients.

- ``HeadDeadline`` wraps aiohttp's protocol for each connection: a request head (request line and
  headers) must arrive within ``timeout_s`` of the connection opening or of its first byte, else
  the connection is closed. aiohttp itself has no such timeout, so a few hundred sockets that
  trickle header bytes ("slowloris") would otherwise be held for as long as they keep trickling.
  Idle keep-alive connections (no bytes at all after a request) are left to aiohttp.
- ``read_body`` reads a request body within a byte limit (413 from ``Content-Length`` before reading
  anything) and a time limit (408), without keeping a second copy on the request object.
- ``claim_unix_socket`` refuses a socket path another process serves on, and removes a stale one.
- ``Cors``: which browser origins may call the API (``[api] cors_origins``), the preflight's answer
  and the headers a response to an allowed origin carries. No origin configured: no CORS headers.
- ``client_left``: a client that goes away (while its body arrives, while it waits, mid-response) is one
  log line without a traceback, at most one per ``LOG_EVERY_S`` however many clients leave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import Any

from ....errors import EdgeAgentError
from ....logsetup import LogLimiter

log = logging.getLogger(__name__)
DEPARTURES = LogLimiter(logger=logging.getLogger("edge_agent.serving.doors.http.server"))  # see client_left


def client_left(fmt: str, *args: Any) -> None:
    """Say that a client went away (``fmt`` goes on from "client went away"): one line a period (module doc)."""
    DEPARTURES(logging.INFO, "client_left", "client went away" + fmt, *args)


body_bytes: ContextVar[int] = ContextVar("body_bytes", default=0)  # of the request this task serves


class BodyError(Exception):
    """A request body the API will not read: ``status`` 413 (too large) or 408 (too slow)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Cors:
    """The CORS policy for ``origins`` (``"*"``: any). ``allowed(origin)`` says whether a page from
    ``origin`` may read responses; ``preflight_headers`` answers its preflight (the methods, the
    headers it asked for, Chrome's private-network access to a loopback address); ``response_headers``
    go on every response to it: the origin itself (never ``*``, so credentials work) and
    ``Vary: Origin``, so a cache never hands one origin's answer to another."""

    METHODS = "GET, POST, OPTIONS"
    EXPOSED = "Retry-After, Server-Timing, Warning"  # what the API says in headers, readable from a page
    MAX_AGE_S = 600

    def __init__(self, origins: Iterable[str] = ()) -> None:
        self.origins = frozenset(origins)

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allowed(self, origin: str | None) -> bool:
        return bool(origin) and ("*" in self.origins or origin in self.origins)

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers

    def response_headers(self, origin: str) -> dict[str, str]:
        return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": self.EXPOSED}

    def preflight_headers(self, origin: str, headers: Mapping[str, str]) -> dict[str, str]:
        out = {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": self.METHODS,
            "Access-Control-Allow-Headers": headers.get("Access-Control-Request-Headers")
            or "Authorization, Content-Type",
            "Access-Control-Max-Age": str(self.MAX_AGE_S),
            "Vary": "Origin",
        }
        if headers.get("Access-Control-Request-Private-Network", "").lower() == "true":
            out["Access-Control-Allow-Private-Network"] = "true"
        return out


class HeadDeadline(asyncio.Protocol):
    """One connection: aiohttp's protocol (``inner``), and a deadline for each request head.

    The deadline is armed when the connection opens and again by the first byte after a request;
    ``started()`` (called once aiohttp hands the parsed request to the app) disarms it.
    """

    def __init__(self, inner: asyncio.Protocol, timeout_s: float, registry: dict[Any, HeadDeadline]) -> None:
        self.inner, self.timeout_s, self._registry = inner, timeout_s, registry
        self.transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self.dropped = False

    # asyncio.Protocol, forwarded
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._registry[transport] = self
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy and self._timer is None:
            self._arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._registry.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # the app's side
    def started(self) -> None:
        self._busy = True
        self._disarm()

    def finished(self) -> None:
        self._busy = False

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._busy or self.transport is None or self.transport.is_closing():
            return
        self.dropped = True
        log.info(
            "closed a connection from %s: no complete request head within %g s",
            self.transport.get_extra_info("peername") or "the unix socket",
            self.timeout_s,
        )
        self.transport.close()


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body of ``request``, or ``BodyError`` (413 over ``max_bytes``, 408 past ``timeout_s``)."""
    too_large = BodyError(413, f"request body larger than {max_bytes // 2**20} MiB", "request_too_large")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large  # refused unread (aiohttp discards the rest for a while, so the client sees this)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyError(
            408, f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)", "request_timeout"
        ) from None
    body_bytes.set(size)
    return b"".join(chunks)


def claim_unix_socket(path: str) -> None:
    """Make ``path`` free to bind: refuse it when something accepts connections there (another agent),
    remove it when it is a stale socket file, refuse anything that is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EdgeAgentError(f"api.unix_socket {path}: exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):  # nobody listens: left behind by a process that died
        log.info("removing the stale socket %s", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    except TimeoutError:
        pass  # a listener too busy to accept is still a listener
    except OSError as exc:
        raise EdgeAgentError(
            f"api.unix_socket {path}: cannot check whether it is in use: {exc.strerror or exc}"
        ) from exc
    finally:
        probe.close()
    raise EdgeAgentError(
        f"api.unix_socket {path}: another process is already serving on it (a second "
        "edge-agent?); stop that one or set another api.unix_socket"
    )


def exposure_warning(host: str, port: int, token: str | None, unix_socket: str | None) -> str | None:
    """The warning for an API other machines can reach without a token (None when there is none)."""
    from ....config import ApiConfig

    if unix_socket or token or ApiConfig.is_loopback(host):
        return None
    return (
        f"the API on {host or '*'}:{port} is reachable from other machines and has NO token "
        "(api.allow_unauthenticated = true): anyone who can reach it can use the models; set api.token "
        "or keep api.host on loopback"
    )
