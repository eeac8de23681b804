"""The Wyoming protocol server in the daemon: Home Assistant's voice pipeline on the agent's tiers (docs/wyoming.md).

Wyoming is JSON lines with optional binary payloads over TCP. This server speaks it with the ``wyoming``
library's events on its own thread and asyncio loop, as a thin adapter over the same serving layer as
the HTTP API (``session``): ``describe`` -> ``info``; ``transcribe`` + ``audio-start`` /
``audio-chunk`` / ``audio-stop`` -> ``transcript-start``, ``transcript-chunk`` …, ``transcript``,
``transcript-stop`` on the ASR ladder; ``transcript`` -> ``handled-start``, ``handled-chunk`` …,
``handled``, ``handled-stop`` (or ``not-handled``) on the LLM ladder.

What one connection cannot do to the others (each is closed with one log line saying why):

- a header line over ``MAX_LINE`` bytes, one that is not a JSON object with a ``type``, ``data`` over
  ``MAX_DATA`` bytes or a payload over ``MAX_PAYLOAD`` bytes (nothing is read into memory first);
- audio that cannot be what its header says (``audio.BadAudio``), audio before ``audio-start``,
  more than ``max_audio_s`` of audio in one request;
- sending nothing for ``idle_timeout_s`` (a client that vanished without closing, an idle socket);
- a client that stops reading: a write that cannot finish within ``WRITE_TIMEOUT_S``.

Past ``max_connections`` a new connection is closed at once (logged, at most a line per second with
the count held back). Memory per connection is bounded by these limits, the audio conversion's bound per
chunk (``audio``) and the ASR stream's backlog bound (``serving/asr/tiers.py``), so the server's
memory is bounded by ``max_connections``. A stop closes every open connection, each with a log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ....config import WyomingConfig
from ....errors import EdgeAgentError
from ....logsetup import LogLimiter
from ..host import LoopThread
from ..ladders import LlmLadder, SpeechLadder
from .audio import BadAudio
from .info import Offer
from .protocol import MAX_LINE, ProtocolError, wyoming_events
from .session import Session

log = logging.getLogger(__name__)


class WyomingServer:
    """The Wyoming server on a thread of its own (see the module doc): ``start()``, ``address``, ``stop()``."""

    def __init__(
        self,
        config: WyomingConfig,
        asr: SpeechLadder | None = None,
        llm: LlmLadder | None = None,
        count: Callable[[str, str], None] | None = None,
        version: str = "",
    ) -> None:
        """``asr``, ``llm``: the ladders served (None: not that one); ``count(kind, outcome)``: each Wyoming
        request, for ``/metrics``."""
        self.config = config
        self.count = count or (lambda kind, outcome: None)
        self.offer = Offer(config, asr, llm, self.count, version)  # what each connection is served
        self.address: tuple[str, int] | None = None
        self.connections = 0
        self.draining = False
        self._host = LoopThread("wyoming")
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._limited = LogLimiter(1.0, logger=log)
        self._zeroconf: Any = None

    def start(self) -> WyomingServer:
        wyoming_events()
        cfg = self.config
        self._host.start(self._listen, self._shutdown, f"the Wyoming server could not listen on {cfg.host}:{cfg.port}")
        if not self._is_loopback():
            log.warning(
                "SECURITY: the Wyoming server on %s:%d is reachable from other machines and the protocol has no "
                "authentication (wyoming.allow_remote = true)",
                *self.address,  # type: ignore[misc]  # set once listening
            )
        log.info("Wyoming server on tcp://%s:%d", *self.address)  # type: ignore[misc]
        return self

    async def _listen(self) -> None:
        cfg = self.config
        self._server = await asyncio.start_server(self._accept, cfg.host, cfg.port, limit=MAX_LINE, reuse_address=True)
        name = self._server.sockets[0].getsockname()
        self.address = (name[0], name[1])
        if cfg.announce:  # zeroconf missing fails the start, as a port taken does
            self._zeroconf = await self._announce()

    @property
    def ticks(self) -> int:
        """Advanced by the loop every ``host.TICK_S``: the watchdog's sign that it is not blocked."""
        return self._host.ticks

    def _is_loopback(self) -> bool:
        from ....config import ApiConfig

        return ApiConfig.is_loopback(self.config.host)

    async def _announce(self) -> Any:
        try:
            from wyoming.zeroconf import HomeAssistantZeroconf
        except ImportError as exc:
            raise EdgeAgentError("wyoming.announce needs the 'zeroconf' package: pip install zeroconf") from exc
        assert self.address is not None
        host = None if self.address[0] in ("0.0.0.0", "::") else self.address[0]
        zc = HomeAssistantZeroconf(port=self.address[1], name=self.config.name, host=host)
        await zc.register_server()
        log.info("Wyoming server announced over zeroconf as %s._wyoming._tcp.local.", self.config.name)
        return zc

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
        if self.draining or self.connections >= self.config.max_connections:
            why = "the server is stopping" if self.draining else f"{self.config.max_connections} connections are open"
            self._limited(logging.WARNING, "refused", "Wyoming connection from %s closed: %s", who, why)
            self.count("connection", "refused")
            writer.close()
            return
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        session = Session(self.offer, reader, writer, who)
        logged = True
        try:
            await session.run()
            logged = False
        except ProtocolError as exc:
            log.warning("Wyoming connection from %s closed: %s", who, exc)
            self.count("connection", "protocol_error")
        except BadAudio as exc:
            log.warning("Wyoming connection from %s closed: bad audio: %s", who, exc)
            self.count("connection", "bad_audio")
        except (ConnectionError, asyncio.TimeoutError) as exc:
            log.info("Wyoming connection from %s closed: the client went away (%s)", who, type(exc).__name__)
            logged = False  # what it left behind is said next
        except asyncio.CancelledError:  # the server is stopping (``_shutdown``): this task ends here, cleanly
            log.info("Wyoming connection from %s closed: the server is stopping", who)
        except Exception:
            log.exception("Wyoming connection from %s closed: an internal error", who)
        finally:
            await session.close(logged)
            self.connections -= 1
            if task is not None:
                self._tasks.discard(task)
            writer.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._zeroconf is not None:
            try:
                await self._zeroconf._aiozc.async_close()
            except Exception:
                log.debug("zeroconf close failed", exc_info=True)

    def stop(self) -> None:
        self.draining = True
        self._host.stop()
