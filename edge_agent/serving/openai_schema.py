"""The OpenAI request bodies the local API accepts, parsed strictly.

Strict types: ``max_tokens: true`` or ``stream: "yes"`` is a 400, not 1 and True (only an integer
may stand for a float). The body is parsed by pydantic's own JSON parser, which refuses what Python's
``json`` lets through: lone UTF-16 surrogates (``"\\ud800"``), NaN and Infinity, and nesting deeper
than a request ever needs; each is a ``ValidationError`` the API answers with 400.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InputError
from ..models.sampling import SamplingParams

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class GenerateRequest(BaseModel):
    """The generation parameters both OpenAI endpoints share; unknown fields are refused."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: dict | None = None
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not supported: use repetition_penalty")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="not supported: use repetition_penalty")

    def params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=self.max_completion_tokens or self.max_tokens or 256,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    """One chat message; content is text or OpenAI's list of parts (the text parts are used)."""

    model_config = _STRICT
    role: str = Field(pattern="^(system|user|assistant|developer)$")
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise InputError("only text content parts are supported")
        return "".join(parts)


class ChatRequest(GenerateRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(GenerateRequest):
    """``POST /v1/completions``."""

    prompt: str = Field(min_length=1)


def parse(raw: bytes, model: type[GenerateRequest]) -> GenerateRequest:
    """The request in ``raw`` (a JSON object), or ``InputError``/``ValidationError`` saying what is wrong."""
    if not raw.strip():
        raise InputError("the body is empty: send a JSON object")
    return model.model_validate_json(raw)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem, worded for the client."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(x) for x in first["loc"])
    if first["type"] == "json_invalid":
        detail = first["msg"].removeprefix("Invalid JSON: ")
        if "recursion limit" in detail:
            detail += " (nested too deeply)"
        elif "escape" in detail or "code point" in detail:
            detail += " (a lone UTF-16 surrogate such as \\ud800, or bytes that are not UTF-8, is not text)"
        return f"the body is not valid JSON: {detail}", None
    if not where and first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return "the body must be a JSON object", None
    return f"{where}: {first['msg']}", where or None
