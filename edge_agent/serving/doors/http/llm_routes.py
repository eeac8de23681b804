"""The local API's generation routes, on the API's loop (``server.ApiServer`` routes them here):

    POST /v1/chat/completions     chat, streaming (SSE) or not; response_format, tools, logprobs
    POST /v1/completions          raw prompt, streaming or not; logprobs, echo

The body is parsed, the prompt measured and tokenized and the output format compiled on the
executor, never on the loop. The response's ``model`` is the tier that answered (``GET /v1/models``
lists it) and ``system_fingerprint`` the engine it ran; ``timings`` (the same figures the daemon's
metrics record for the request) come in the body, or in the last chunk when streaming, with a
``Server-Timing`` header on non-streamed responses. A ``max_tokens`` above the tier's cap is
clamped and the response says so (``warnings``, ``timings.max_tokens``). An output format that cannot
start is a 400 naming ``response_format`` or ``tools``, before the request is admitted; one that
breaks later fails that request alone (a 400, or an error chunk when streaming).

Token events reach the loop through a sink that posts them to its mailbox (``doors.host.Mailbox``)
from the scheduler thread, with no thread per request. A client that goes away has its request
cancelled (its batch slot is freed), logged on one line.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from aiohttp import web

from ....errors import DeadlineExceeded, EdgeAgentError, InputError, Overloaded
from ....metrics.prometheus import PrometheusMetrics
from ....models.grammar import FormatError
from ...llm.handle import Completion, RequestHandle, TokenEvent
from ..host import Mailbox
from ..ladders import LlmLadder
from ..openai import output as openai_output
from ..openai.schema import ChatRequest, CompletionRequest, GenerateRequest, parse
from . import guard
from .errors import from_exception as _from_exception

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.05
DISCONNECTS = (ConnectionResetError, BrokenPipeError)  # aiohttp's ClientConnectionResetError included
FINISH = {"stop": "stop", "length": "length", "deadline": "length", "cancelled": "stop", "repetition": "stop"}


async def read_request(request: web.Request, model: type[GenerateRequest], max_body: int, timeout_s: float):
    """Read the body (bounded in size and time), then parse it on the executor: a large body must not
    hold the loop."""
    raw = await guard.read_body(request, max_body, timeout_s)
    return await asyncio.get_running_loop().run_in_executor(None, parse, raw, model)


def _prepare(llm: LlmLadder, body: GenerateRequest) -> tuple[list[RequestHandle], openai_output.Plan]:
    """On the executor: the output format compiled, the prompt measured, tokenized and admitted, once
    per choice (``n``). Choice ``i`` of a seeded request draws with ``seed + i``: the choices differ
    but a rerun gives the same ones. If one choice cannot be admitted, the ones already admitted are
    cancelled and the request fails as a whole."""
    plan = openai_output.plan(body)
    handles: list[RequestHandle] = []
    try:
        for i in range(body.n):
            params = (
                plan.params if i == 0 or plan.params.seed is None else replace(plan.params, seed=plan.params.seed + i)
            )
            handles.append(
                llm.submit(plan.prompt, params, raw=not isinstance(body, ChatRequest), budget_ms=body.deadline_ms)
            )
    except BaseException as exc:
        for handle in handles:
            handle.cancel()
        raise _named(exc, plan) from None
    return handles, plan


def _named(exc: BaseException, plan: openai_output.Plan) -> BaseException:
    """A broken output format as the client's mistake in the field it came from."""
    if not isinstance(exc, FormatError):
        return exc
    param = "tools" if plan.tools else "response_format"
    return InputError(f"{param}: {exc}", param=param)


async def generate(
    llm: LlmLadder, metrics: PrometheusMetrics, request: web.Request, body: GenerateRequest
) -> web.StreamResponse:
    """Answer one parsed chat or completion request (see the module doc)."""
    loop = asyncio.get_running_loop()
    chat = isinstance(body, ChatRequest)
    try:
        handles, plan = await loop.run_in_executor(None, functools.partial(_prepare, llm, body))
    except Exception as exc:
        _count_refusal(metrics, exc)
        return _from_exception(exc)
    reply = _Reply(handles, plan, body, chat)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handles, reply.ident))
    try:
        events = _events(handles, loop)
        if body.stream:
            # The headers wait for the first event: a request refused before it started (its start
            # deadline) is answered with its status, never as an error inside a 200 stream.
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = None
            except Exception as exc:
                reply._cancel()
                _count_refusal(metrics, exc)
                return _from_exception(_named(exc, plan))
            return await reply.stream(request, _chain(first, events))
        try:
            async for _ in events:
                pass
            done = [h.result(5) for h in handles]  # the events ended: every choice is finished
        except Exception as exc:
            for handle in handles:
                handle.cancel()
            _count_refusal(metrics, exc)
            return _from_exception(_named(exc, plan))
        return reply.whole(done)
    finally:
        watcher.cancel()


class _Reply:
    """One response in OpenAI's shape, whole or as SSE chunks: one choice per request handle, in
    ``index`` order. Envelope, top-level ``timings`` and ``warnings`` are the first choice's; with
    ``n > 1`` each choice also carries its own ``timings``."""

    def __init__(
        self, handles: list[RequestHandle], plan: openai_output.Plan, body: GenerateRequest, chat: bool
    ) -> None:
        self.handles, self.plan, self.chat = handles, plan, chat
        self.handle = handles[0]
        self.ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.requested = body.requested_max_tokens
        self.want_timings = body.timings
        self.include_usage = body.include_usage
        self.echo = body.prompt if isinstance(body, CompletionRequest) and body.echo else ""

    def _envelope(self, kind: str) -> dict[str, Any]:
        h = self.handle
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": h.tier or "edge-agent",
            "system_fingerprint": h.engine,
        }

    def _extras(self, done: Completion, index: int = 0) -> dict[str, Any]:
        handle = self.handles[index]
        out: dict[str, Any] = {}
        if self.want_timings:
            out["timings"] = openai_output.timings(handle, done.timing, self.requested)
        warning = openai_output.clamp_warning(handle, self.requested)
        if warning:
            out["warnings"] = [warning]
        return out

    @staticmethod
    def _usage(done: list[Completion]) -> dict[str, Any]:
        return openai_output.usage(done[0].timing, sum(len(d.token_ids) for d in done))

    def _choice(self, index: int, done: Completion) -> dict[str, Any]:
        reason = FINISH.get(done.finish_reason, "stop")
        logprobs = self.plan.params.logprobs is not None
        choice: dict[str, Any]
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": done.text, "refusal": None}
            if self.plan.tools:
                content, call, complete = openai_output.split_tool_call(done.text)
                if call is not None:
                    message.update(content=content, tool_calls=[call])
                    reason = "tool_calls" if complete else reason
            choice = {"index": index, "message": message}
            choice["logprobs"] = openai_output.chat_logprobs(done.logprobs) if logprobs else None
        else:
            lp = openai_output.completion_logprobs(done.logprobs, len(self.echo)) if logprobs else None
            choice = {"index": index, "text": self.echo + done.text, "logprobs": lp}
        choice["finish_reason"] = reason
        if len(self.handles) > 1 and self.want_timings:
            choice["timings"] = openai_output.timings(self.handles[index], done.timing, self.requested)
        return choice

    def whole(self, done: list[Completion]) -> web.Response:
        body = {
            **self._envelope("chat.completion" if self.chat else "text_completion"),
            "choices": [self._choice(i, d) for i, d in enumerate(done)],
            "usage": self._usage(done),
            **self._extras(done[0]),
        }
        headers = {}
        if "timings" in body:
            headers["Server-Timing"] = openai_output.server_timing(body["timings"])
        return web.json_response(body, headers=headers)

    async def stream(self, request: web.Request, events) -> web.StreamResponse:
        """Write the reply as SSE chunks as the token ``events`` arrive. A client that goes away, or
        a failure after the headers went out, cancels every choice; the failure is reported in-band."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sse = _SseChunks(self, resp)
        try:
            await resp.prepare(request)
            await sse.opening()
            async for i, event in events:
                if event is None:
                    await sse.finish(i)
                else:
                    await sse.token(i, event)
            await sse.close()
        except DISCONNECTS:  # the client went away: free its batch slots, say so once, no traceback
            if not all(h.cancelled for h in self.handles):
                self._cancel()
                guard.client_left(": %s cancelled", self.ident)
        except asyncio.CancelledError:
            self._cancel()
            raise
        except EdgeAgentError as exc:  # a failure after the headers went out: report it in-band
            self._cancel()
            await sse.fail(exc)
        return resp

    def _cancel(self) -> None:
        """Cancel every choice's request (frees their batch slots)."""
        for handle in self.handles:
            handle.cancel()


class _SseChunks:
    """The SSE chunks of one streamed reply and what they need to remember per choice: its tool-call
    parser, where its next text starts (completion logprobs' offsets) and its completion once finished."""

    def __init__(self, reply: _Reply, resp: web.StreamResponse) -> None:
        self.reply, self.resp, self.chat = reply, resp, reply.chat
        self.envelope = reply._envelope("chat.completion.chunk" if reply.chat else "text_completion")
        self.logprobs = reply.plan.params.logprobs is not None
        n = len(reply.handles)
        self.calls = [openai_output.ToolCallStream() if reply.plan.tools else None for _ in range(n)]
        self.offsets = [len(reply.echo)] * n
        self.done: list[Completion | None] = [None] * n

    async def send(self, choice: dict | None, **extra: Any) -> None:
        """Write one chunk: the envelope, ``choice`` (none: an empty ``choices``) and ``extra`` keys."""
        chunk = {**self.envelope, "choices": [choice] if choice else [], **extra}
        await self.resp.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

    def choice(self, index: int, delta: dict | None = None, text: str = "", lp=None, reason: str | None = None) -> dict:
        """One choice's entry in a chunk: a ``delta`` for chat, a ``text`` for a completion."""
        if self.chat:
            return {"index": index, "delta": delta or {}, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}

    async def opening(self) -> None:
        """The chunks before any token: the assistant's role for chat, the echoed prompt for a completion."""
        for i in range(len(self.calls)):
            if self.chat:
                await self.send(self.choice(i, {"role": "assistant", "content": ""}))
            elif self.reply.echo:
                await self.send(self.choice(i, text=self.reply.echo))

    def _token_logprobs(self, index: int, event: TokenEvent):
        """The logprobs of one token in the reply's shape; None when the request did not ask for them."""
        if not self.logprobs or event.logprob is None:
            return None
        if self.chat:
            return openai_output.chat_logprobs([event.logprob])
        return openai_output.completion_logprobs([event.logprob], self.offsets[index])

    async def token(self, index: int, event: TokenEvent) -> None:
        """The chunks of one token of choice ``index``: its text as content or, with tools, what the
        tool-call parser makes of it (content, call deltas, or nothing yet). Its logprobs ride on the
        first of those chunks, or on an empty delta of their own when there is none."""
        lp = self._token_logprobs(index, event)
        stream = self.calls[index]
        if stream is not None:
            for delta in stream.push(event.text):
                await self.send(self.choice(index, delta, lp=lp))
                lp = None
            if lp is not None:
                await self.send(self.choice(index, {}, lp=lp))
        elif event.text or lp is not None:
            await self.send(self.choice(index, {"content": event.text}, event.text, lp))
        self.offsets[index] += len(event.text)

    async def finish(self, index: int) -> None:
        """The last chunks of choice ``index``, whose events ended: what its tool-call parser still
        held, then its finish reason (``tool_calls`` for a complete call) with its timings and warnings."""
        result = self.done[index] = self.reply.handles[index].result(5)  # its events ended: it is finished
        reason = FINISH.get(result.finish_reason, "stop")
        stream = self.calls[index]
        if stream is not None:
            for delta in stream.finish():
                await self.send(self.choice(index, delta))
            if stream.kind == "call" and openai_output.tool_call(stream.text) is not None:
                reason = "tool_calls"
        await self.send(self.choice(index, reason=reason), **self.reply._extras(result, index))

    async def close(self) -> None:
        """The end of a stream that completed: the usage chunk when asked for, then ``[DONE]``."""
        if self.reply.include_usage:
            await self.send(None, usage=self.reply._usage([d for d in self.done if d is not None]))
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    async def fail(self, exc: EdgeAgentError) -> None:
        """The end of a stream that failed after its headers went out: an error chunk, then
        ``[DONE]``; a client already gone gets nothing."""
        try:
            await self.resp.write(
                f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n".encode()
            )
            await self.resp.write(b"data: [DONE]\n\n")
            await self.resp.write_eof()
        except DISCONNECTS:
            pass


def _count_refusal(metrics: PrometheusMetrics, exc: BaseException) -> None:
    """A request refused or timed out before it started, in ``/metrics`` (by reason and class)."""
    if isinstance(exc, Overloaded):
        metrics.failed("llm", type(exc).__name__)
        metrics.refused.labels("llm", exc.reason, "chat").inc()
    elif isinstance(exc, DeadlineExceeded):
        metrics.failed("llm", type(exc).__name__)


async def _chain(first, events):
    """``first`` (when not None), then the rest of ``events``."""
    if first is not None:
        yield first
    async for item in events:
        yield item


async def _cancel_on_disconnect(request: web.Request, handles: list[RequestHandle], ident: str) -> None:
    """Cancel ``handles`` as soon as the client's connection is gone (aiohttp does not cancel a
    handler by itself, and a non-streaming one writes nothing that could fail until the end)."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            if not all(h.cancelled for h in handles):
                for handle in handles:
                    handle.cancel()
                guard.client_left(": %s cancelled", ident)
            return


def _events(handles: list[RequestHandle], loop: asyncio.AbstractEventLoop):
    """An async iterator over the token events of one or more request handles, as ``(index, event)``
    in arrival order, ``(index, None)`` once handle ``index`` has finished; it ends when all have.
    The scheduler thread posts each event to this loop's mailbox (``RequestHandle.set_sink``), no thread
    in between. A handle that failed raises its error."""
    box: Mailbox[tuple[int, TokenEvent | None]] = Mailbox(loop)
    for i, handle in enumerate(handles):
        handle.set_sink(functools.partial(_post_indexed, box, i))

    async def events():
        open_ = len(handles)
        while open_:
            index, item = await box.get()
            if item is None:
                error = handles[index].error
                if error is not None:
                    raise error
                open_ -= 1
            yield index, item

    return events()


def _post_indexed(box: Mailbox[tuple[int, TokenEvent | None]], index: int, item: TokenEvent | None) -> None:
    box.post((index, item))
