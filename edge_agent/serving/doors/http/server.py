"""The local HTTP API: OpenAI-compatible endpoints, health and Prometheus metrics (aiohttp).

    POST /v1/chat/completions     chat, streaming (SSE) or not
    POST /v1/completions          raw prompt, streaming or not
    GET  /v1/models               the configured tiers (LLM, then ASR) and the ASR aliases
    GET  /v1/models/{id}          one of them (404 ``model_not_found`` for any other id)
    POST /v1/audio/transcriptions multipart file → text (OpenAI's shape)
    GET  /v1/audio/stream         WebSocket: binary 16 kHz mono PCM16 in, partial/final JSON out
    GET  /health                  liveness and what is serving
    GET  /metrics                 Prometheus text

Browsers: pages from the origins in ``cors_origins`` (``[api] cors_origins``; ``"*"`` any) get their
preflight answered (204, before the token is asked for) and ``Access-Control-Allow-Origin`` on every
response; any other origin's preflight is a 403 and its responses carry no CORS headers.

Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 for bad
requests, 401 without the bearer token, 404 for unknown models, 413 for oversized bodies, 429
(queue full) and 503 (shedding or draining) with ``Retry-After``. The server runs its own asyncio
loop on one thread (``doors.host.LoopThread``); engine work stays on the device threads, and each
streaming response is bridged from its request handles by a ``doors.host.Mailbox``.

Nothing slow runs on that loop: a body is read within ``body_timeout_s`` and parsed, and a prompt
tokenized, on the executor; a prompt that cannot fit the context is refused before tokenizing
(``llm.tiers.MAX_CHARS_PER_TOKEN``). Each connection must deliver a request head within
``header_timeout_s`` (``guard.HeadDeadline``). A client that goes away, streaming or not, has
its request cancelled (its batch slot is freed), logged on one line. The loop ticks ``ticks`` so the
watchdog can tell it is alive.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from ....errors import EdgeAgentError
from ....heap import release_freed_heap
from ....metrics.prometheus import CONTENT_TYPE_LATEST, PrometheusMetrics
from ..host import LoopThread
from ..ladders import LlmLadder, SpeechLadder
from ..openai.schema import ChatRequest, CompletionRequest
from . import guard, llm_routes, speech_routes
from .errors import error as _error
from .errors import from_exception as _from_exception
from .errors import model_not_found
from .speech_routes import ASR_ALIASES

log = logging.getLogger(__name__)
MAX_BODY = 32 * 1024 * 1024  # audio uploads included
HEADER_TIMEOUT_S = 5.0  # a request head (line and headers) must arrive within this
BODY_TIMEOUT_S = 30.0  # and a JSON body within this (a 32 MiB body over a 10 Mbit/s link takes ~27 s)
RELEASE_AFTER = 1 << 20  # bodies at least this big: hand the heap they used back to the OS afterwards
DISCONNECTS = (ConnectionResetError, BrokenPipeError)  # aiohttp's ClientConnectionResetError included


class ApiServer:
    """The local API on its own thread and asyncio loop (see the module doc): ``start(host, port,
    unix_socket)``, ``draining`` (new requests get 503 while the rest finish), ``stop``. The LLM
    routes are here; the speech routes are ``speech_routes``, errors are shaped by ``errors``."""

    def __init__(
        self,
        llm: LlmLadder | None,
        metrics: PrometheusMetrics | None = None,
        token: str | None = None,
        asr: SpeechLadder | None = None,
        health: Callable[[], dict] | None = None,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        cors_origins: Iterable[str] = (),
        voice_options: dict | None = None,
    ) -> None:
        if token is not None and not token.strip():
            raise EdgeAgentError("the API token is empty: give a secret, or None to serve without one")
        self.llm, self.asr, self.token = llm, asr, token
        self._expected = f"Bearer {token}".encode() if token else b""
        self.metrics = metrics or PrometheusMetrics()
        self._health = health or (lambda: {})
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.cors = guard.Cors(cors_origins)
        self.voice_options = voice_options or {}  # the voice turns of ``/v1/audio/stream?respond=true``
        self.draining = False
        self._host = LoopThread("api")
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[Any, guard.HeadDeadline] = {}
        self.address = ""

    # -- the app -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        app.on_response_prepare.append(self._cors_headers)  # every response, streamed ones and errors too
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{id:.+}", self._model)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)  # speech_routes.py
        app.router.add_get("/v1/audio/stream", self._audio_stream)
        app.router.add_get("/health", self._health_route)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        connection = self._connections.get(request.transport)
        if connection is not None:
            connection.started()  # the head is in: its deadline no longer applies
        try:
            if guard.Cors.is_preflight(request.method, request.headers):
                return self._preflight(request)  # before the token: a browser never sends it on a preflight
            if self.token and request.path not in ("/health",) and not self._authorized(request):
                return _error(401, "missing or wrong bearer token (Authorization: Bearer …)", code="invalid_api_key")
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 413:
                return _error(413, f"request body larger than {MAX_BODY // 2**20} MiB", code="request_too_large")
            if exc.status in (404, 405):
                return _error(exc.status, f"{request.method} {request.path}: {exc.reason}", code="not_found")
            raise
        except DISCONNECTS:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not the client's connection: a real error, logged as one
            guard.client_left(" during %s %s", request.method, request.path)
            return web.Response(status=499)  # never delivered: aiohttp drops it quietly
        finally:
            if connection is not None:
                connection.finished()
            if guard.body_bytes.get() >= RELEASE_AFTER:
                asyncio.get_running_loop().run_in_executor(None, release_freed_heap)

    def _preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        if not self.cors.allowed(origin):
            return _error(
                403,
                f"origin {origin!r} may not call this API from a browser: list it in [api] cors_origins",
                code="origin_not_allowed",
            )
        return web.Response(status=204, headers=self.cors.preflight_headers(origin, request.headers))

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and self.cors.allowed(origin) and "Access-Control-Allow-Origin" not in response.headers:
            response.headers.update(self.cors.response_headers(origin))
            response.headers.add("Vary", "Origin")

    def _authorized(self, request: web.Request) -> bool:
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(got, self._expected)  # constant time: no timing hints about the token

    def _check_model(self, requested: str | None) -> web.Response | None:
        if self.llm is None:
            return _error(503, "no LLM tier is configured", "server_error", "unavailable")
        known = {"edge-agent", *(t.name for t in self.llm.tiers)}
        if requested and requested not in known:
            return model_not_found(requested, known)
        if self.draining:
            return _error(503, "the agent is shutting down", "server_error", "unavailable", retry_after_s=5)
        return None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await llm_routes.read_request(
                request, ChatRequest if chat else CompletionRequest, MAX_BODY, self.body_timeout_s
            )
        except DISCONNECTS:  # the client left while its body arrived: the guard says so, in one line
            raise
        except Exception as exc:
            return _from_exception(exc)
        refused = self._check_model(body.model)
        if refused is not None:
            return refused
        assert self.llm is not None  # _check_model refused otherwise
        return await llm_routes.generate(self.llm, self.metrics, request, body)

    def model_entries(self) -> list[dict[str, Any]]:
        """``GET /v1/models``' data: the generic id, the LLM tiers, the ASR tiers (a name both ladders
        use is listed once, as the LLM's), then the ASR aliases with the tier they stand for."""
        data: list[dict[str, Any]] = [_model("edge-agent")]
        if self.llm is not None:
            data += [_model(t.name, active=i == self.llm.active) for i, t in enumerate(self.llm.tiers)]
        if self.asr is not None:
            listed = {m["id"] for m in data}
            active = self.asr.active_tier
            data += [_model(t.name, active=t.name == active) for t in self.asr.tiers if t.name not in listed]
            listed = {m["id"] for m in data}
            data += [_model(alias, alias_of=active) for alias in ASR_ALIASES if alias not in listed]
        return data

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.model_entries()})

    async def _model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``): the list's entry."""
        wanted = request.match_info["id"]
        entries = self.model_entries()
        found = next((m for m in entries if m["id"] == wanted), None)
        if found is None:
            return model_not_found(wanted, (m["id"] for m in entries))
        return web.json_response(found)

    async def _transcriptions(self, request: web.Request) -> web.Response:
        return await speech_routes.transcriptions(self.asr, request)

    async def _audio_stream(self, request: web.Request) -> web.StreamResponse:
        return await speech_routes.audio_stream(self.asr, request, self.llm, self.voice_options)

    async def _health_route(self, request: web.Request) -> web.Response:
        """Liveness and, per workload, what is serving: tier, model, load, shedding, switching."""
        body = {"status": "draining" if self.draining else "ok", **self._health()}
        if self.llm is not None:
            waiting, running = self.llm.load
            body["llm"] = {
                "tier": self.llm.active_tier,
                "model": self.llm.model_name,
                "waiting": waiting,
                "running": running,
                "shedding": self.llm.shedding,
                "switching": self.llm.switching,
            }
        if self.asr is not None:
            asr = self.asr
            body["asr"] = {
                "tier": asr.active_tier,
                "model": asr.model,
                "open_streams": sum(asr.open_streams.values()),
                "shedding": asr.shedding,
                "switching": asr.switching,
            }
        return web.json_response(body, status=503 if self.draining else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 8080, unix_socket: str | None = None) -> ApiServer:
        """Serve on a thread of its own; returns once listening (``address`` says where)."""
        if unix_socket:
            guard.claim_unix_socket(unix_socket)  # never silently take over another agent's socket
        warning = guard.exposure_warning(host, port, self.token, unix_socket)
        if warning:
            log.warning("SECURITY: %s", warning)
        self._host.start(
            functools.partial(self._listen, host, port, unix_socket),
            self._close,
            f"the API could not listen on {unix_socket or f'{host}:{port}'}",
        )
        return self

    async def _listen(self, host: str, port: int, unix_socket: str | None) -> None:
        loop = asyncio.get_running_loop()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None  # set up just above

        def connection() -> guard.HeadDeadline:
            return guard.HeadDeadline(server(), self.header_timeout_s, self._connections)

        if unix_socket:
            self._server = await loop.create_unix_server(connection, unix_socket)
            self.address = unix_socket
        else:
            self._server = await loop.create_server(connection, host, port, reuse_address=True)
            name = self._server.sockets[0].getsockname()
            self.address = f"http://{f'[{name[0]}]' if ':' in name[0] else name[0]}:{name[1]}"

    async def _close(self) -> None:
        assert self._server is not None and self._runner is not None  # listening: ``_listen`` set them
        self._server.close()
        await self._runner.cleanup()

    @property
    def ticks(self) -> int:
        """Advanced by the loop every ``host.TICK_S``: the watchdog's sign that it is not blocked."""
        return self._host.ticks

    def stop(self) -> None:
        self._host.stop()


def _model(ident: str, **extra: Any) -> dict[str, Any]:
    """A model object in OpenAI's shape, with the agent's own keys (``active``, ``alias_of``) after."""
    return {"id": ident, "object": "model", "created": 0, "owned_by": "edge-agent", **extra}
