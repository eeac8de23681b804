"""OpenAI-shaped error responses (``{"error": {"message", "type", "param", "code"}}``) for the local
API: what each error of the tree (``edge_agent.errors``) becomes, with ``Retry-After`` where retrying
helps (503 shedding or draining, 429 queue full). A client's mistake is a 4xx with what and where,
never a traceback; only an unexpected error is logged with one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from aiohttp import web
from pydantic import ValidationError

from ....errors import DeadlineExceeded, EdgeAgentError, InputError, Overloaded, Unavailable
from ..openai.schema import validation_message
from . import guard

log = logging.getLogger(__name__)


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    retry_after_s: float | None = None,
    reason: str | None = None,
) -> web.Response:
    """``reason``: why an overloaded request was refused (``Overloaded.reason``), an extension field."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s else None
    body = {"message": message, "type": kind, "param": param, "code": code}
    if reason is not None:
        body["reason"] = reason
    return web.json_response({"error": body}, status=status, headers=headers)


def model_not_found(requested: str, known: Iterable[str]) -> web.Response:
    """The one answer, on every route, to a model this agent does not serve: 404 with OpenAI's
    ``code: "model_not_found"`` and ``param: "model"``, naming the ids that are served."""
    return error(
        404,
        f"model {requested!r} is not served here; GET /v1/models lists {sorted(set(known))}",
        code="model_not_found",
        param="model",
    )


def from_exception(exc: BaseException) -> web.Response:
    if isinstance(exc, ValidationError):
        message, param = validation_message(exc)
        return error(400, message, param=param)
    if isinstance(exc, guard.BodyError):
        return error(exc.status, str(exc), code=exc.code)
    if isinstance(exc, RecursionError):  # nesting a parser refused to follow: the client's mistake
        return error(400, "the body is nested too deeply")
    if isinstance(exc, Unavailable):
        retry = exc.retry_after_s or 5
        return error(503, str(exc), "server_error", "unavailable", retry_after_s=retry, reason=exc.reason)
    if isinstance(exc, Overloaded):
        retry = exc.retry_after_s or 1
        return error(429, str(exc), "rate_limit_error", "overloaded", retry_after_s=retry, reason=exc.reason)
    if isinstance(exc, DeadlineExceeded):
        return error(503, str(exc), "server_error", "timeout", retry_after_s=2)
    if isinstance(exc, (InputError, ValueError)):
        return error(400, str(exc), code=getattr(exc, "code", None), param=getattr(exc, "param", None))
    if isinstance(exc, EdgeAgentError):
        return error(500, str(exc), "server_error")
    log.exception("unexpected API error", exc_info=exc)
    return error(500, f"internal error: {type(exc).__name__}", "server_error")
