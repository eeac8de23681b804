"""The client side of ``bench serve``: streamed OpenAI chat requests over HTTP (aiohttp), timed as an
app sees them, and the three ways of sending them (closed loop, Poisson arrivals, one at a time).

A request's times come from ``time.perf_counter`` as the SSE lines are read: ``ttft_ms`` from sending
the request to the first chunk whose ``delta.content`` is not empty (the role-only chunk does not
count), ``itl_ms`` the gaps between content chunks, ``e2e_ms`` to ``[DONE]``; ``tokens_out`` is the
final usage chunk's ``completion_tokens`` (``stream_options.include_usage``). ``ttfb_ms`` is the
response head (the API sends it once the request is admitted). A token whose text is still pending
(part of a character, or a special token) sends no chunk, so content chunks can be fewer than tokens,
and the first content can come some tokens after the daemon's first token.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

WORDS = (
    "the quick brown fox jumps over a lazy dog while small birds sing in tall green trees near "
    "an old stone bridge where children play and people walk along the quiet river every morning "
    "before work begins in the busy town"
).split()


def make_prompt(words: int, index: int, seed: int) -> str:
    """About ``words`` words (roughly one token each), different for every ``index``."""
    rng = random.Random(seed * 1_000_003 + index)
    return f"Request {index}: " + " ".join(rng.choice(WORDS) for _ in range(max(words - 2, 1)))


@dataclass
class RequestResult:
    """One request as the client saw it; ``status`` is the HTTP status, or what failed instead."""

    ok: bool
    status: str
    ttfb_ms: float | None = None
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float | None = None
    tokens_out: int | None = None
    tokens_in: int | None = None
    error: str = ""


@dataclass(frozen=True)
class Target:
    """Where the daemon listens and how to talk to it."""

    base_url: str
    token: str | None = None
    unix_socket: str | None = None
    timeout_s: float = 600.0

    def session(self) -> aiohttp.ClientSession:
        connector: aiohttp.BaseConnector = (
            aiohttp.UnixConnector(path=self.unix_socket) if self.unix_socket else aiohttp.TCPConnector(limit=0)
        )
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return aiohttp.ClientSession(
            connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )


async def get_text(session: aiohttp.ClientSession, target: Target, path: str) -> tuple[int, str]:
    async with session.get(target.base_url + path) as resp:
        return resp.status, await resp.text()


async def chat_stream(session: aiohttp.ClientSession, target: Target, body: dict) -> RequestResult:
    """Send one streamed chat completion and time it."""
    t0 = time.perf_counter()
    try:
        async with session.post(target.base_url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return RequestResult(False, str(resp.status), error=text)
            result = RequestResult(True, "200", ttfb_ms=(time.perf_counter() - t0) * 1e3)
            last: float | None = None
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    result.e2e_ms = (now - t0) * 1e3
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, "stream_error", error=str(chunk["error"])[:300])
                usage = chunk.get("usage")
                if usage:
                    result.tokens_out = usage.get("completion_tokens")
                    result.tokens_in = usage.get("prompt_tokens")
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        if last is None:
                            result.ttft_ms = (now - t0) * 1e3
                        else:
                            result.itl_ms.append((now - last) * 1e3)
                        last = now
            if result.e2e_ms is None:
                return RequestResult(False, "truncated_stream", error="the stream ended without [DONE]")
            return result
    except asyncio.TimeoutError:
        return RequestResult(False, "timeout", error=f"no answer within {target.timeout_s:g} s")
    except aiohttp.ClientError as exc:
        return RequestResult(False, type(exc).__name__, error=str(exc)[:300])


class Load:
    """Sends ``requests`` requests, or as many as start within ``duration_s``, and collects results."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        body: Callable[[int], dict],
        requests: int | None,
        duration_s: float | None,
        on_done: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.session, self.target, self.body = session, target, body
        self.requests, self.duration_s, self.on_done = requests, duration_s, on_done
        self.results: list[RequestResult] = []
        self._next = 0
        self._start = 0.0

    def _take(self) -> int | None:
        """The next request's index, or None when the load is over."""
        if self.requests is not None and self._next >= self.requests:
            return None
        if self.duration_s is not None and time.perf_counter() - self._start >= self.duration_s:
            return None
        self._next += 1
        return self._next - 1

    async def _one(self, index: int) -> None:
        self.results.append(await chat_stream(self.session, self.target, self.body(index)))
        self.on_done(len(self.results))

    async def closed(self, concurrency: int, ramp_s: float = 0.0) -> float:
        """``concurrency`` clients, each sending its next request when the previous one ends; client k
        starts at k·ramp_s/concurrency (0: all at once, and equal requests then arrive in lockstep). Wall s."""
        self._start = time.perf_counter()

        async def client(k: int) -> None:
            await asyncio.sleep(k * ramp_s / concurrency)
            while (i := self._take()) is not None:
                await self._one(i)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return time.perf_counter() - self._start

    async def poisson(self, rate: float, seed: int) -> float:
        """Open loop: arrivals at ``rate``/s with exponential gaps (seeded), whatever is in flight."""
        rng = random.Random(seed)
        self._start = time.perf_counter()
        due = self._start
        tasks = []
        while (i := self._take()) is not None:
            tasks.append(asyncio.create_task(self._one(i)))
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if self.duration_s is not None and due - self._start >= self.duration_s:
                break
        await asyncio.gather(*tasks)
        return time.perf_counter() - self._start

    async def sequential(self, gap_s: float) -> float:
        """One request at a time, ``gap_s`` of idle between the end of one and the start of the next."""
        self._start = time.perf_counter()
        while (i := self._take()) is not None:
            if i:
                await asyncio.sleep(gap_s)
            await self._one(i)
        return time.perf_counter() - self._start
