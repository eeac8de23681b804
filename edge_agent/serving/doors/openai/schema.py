"""The OpenAI request bodies the local API accepts, parsed strictly.

Nothing is silently ignored: every field OpenAI defines for these endpoints is either honoured or
refused with a 400 that names it (``store: true``, ``audio``, ``functions``, ``n: 9``, …), and a field
OpenAI does not define is refused too. Labels that never change the output (``user``, ``metadata``,
``safety_identifier``, ``prompt_cache_key``) are accepted, as OpenAI does.

Strict types: ``max_tokens: true`` or ``stream: "yes"`` is a 400, not 1 and True (only an integer
may stand for a float). The body is parsed by pydantic's own JSON parser, which refuses what Python's
``json`` lets through: lone UTF-16 surrogates (``"\\ud800"``), NaN and Infinity, and nesting deeper
than a request ever needs; each is a ``ValidationError`` the API answers with 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ....errors import InputError

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_CHOICES = 8  # n: each choice is a sequence of its own in the batch, so n is bounded like a burst of requests
_NOT_SUPPORTED = {  # OpenAI fields the agent refuses unless they are absent or neutral, and why
    "audio": "audio output is not produced here",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the served models do not reason in separate steps",
    "web_search_options": "there is no web search on the device",
    "functions": "use `tools` (the legacy `functions` field is not supported)",
    "function_call": "use `tool_choice` (the legacy `function_call` field is not supported)",
    "suffix": "insertion (suffix) is not supported",
    "verbosity": "verbosity is not supported",
}


class GenerateRequest(BaseModel):
    """The fields both OpenAI generation endpoints share (see the module doc for what is refused)."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each a sequence of its own in the batch")
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # a label: accepted, never changes the output
    metadata: dict[str, str] | None = None  # a label
    safety_identifier: str | None = None  # a label
    prompt_cache_key: str | None = None  # a label
    store: bool | None = Field(None, description="nothing is stored on the device: only false")
    service_tier: Literal["auto", "default"] | None = None
    # Extensions (not OpenAI's): the agent's own sampling knobs and per-request timings.
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    timings: bool = True  # a `timings` object in the response (the last chunk when streaming)
    deadline_ms: float | None = Field(
        None,
        gt=0,
        le=600_000,
        description="the client's own first-token budget: refused (429) unless its first token is predicted "
        "within it, and if not started within it; the SLA's budget applies when that is shorter",
    )
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerateRequest:
        for name, why in _NOT_SUPPORTED.items():
            if getattr(self, name, None) not in (None, [], {}):
                raise ValueError(f"{name}: {why}")
        if self.store:
            raise ValueError("store: nothing is stored on the device; send false or leave it out")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InputError(f"logit_bias: keys are token ids, got {key!r}", param="logit_bias")
            if not -100 <= value <= 100:
                raise InputError(f"logit_bias[{key}]: must lie in [-100, 100], got {value}", param="logit_bias")
            out.append((int(key), float(value)))
        return tuple(out)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    """``stream_options``: usage in a last chunk of its own."""

    model_config = _STRICT
    include_usage: bool = False
    include_obfuscation: bool = False  # padding against length side channels: there is no network hop to hide


class ToolFunction(BaseModel):
    """A function tool's declaration."""

    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls always follow the parameters schema here: strict or not


class Tool(BaseModel):
    """One entry of ``tools``: only function tools exist on the device."""

    model_config = _STRICT
    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = _STRICT
    type: Literal["function"]
    function: dict[Literal["name"], str]


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``."""

    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(BaseModel):
    """``response_format``: text, any JSON object, or JSON that follows a schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        return self


class ChatMessage(BaseModel):
    """One chat message; content is text or OpenAI's list of parts (the text parts are used)."""

    model_config = _STRICT
    role: str = Field(pattern="^(system|user|assistant|developer|tool)$")
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise InputError("only text content parts are supported")
        return "".join(parts)


class ChatRequest(GenerateRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # at most one call is made per response either way
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    modalities: list[Literal["text"]] | None = None
    functions: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            wanted = self.tool_choice.function.get("name")
            if wanted not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice: no tool named {wanted!r} in tools")
        fmt = self.response_format
        if self.tools and fmt is not None and fmt.type != "text" and self.tool_choice not in (None, "none"):
            raise ValueError("response_format: cannot be combined with tools unless tool_choice is 'none'")
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise ValueError("tools: two tools have the same name")
        return self

    @property
    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerateRequest):
    """``POST /v1/completions``."""

    prompt: str = Field(min_length=1)
    echo: bool = False
    best_of: int = Field(1, ge=1, le=1, description="one candidate per request")
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: Any = None

    @property
    def top_n(self) -> int | None:
        return self.logprobs


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
    if first["type"] == "extra_forbidden":
        return f"{where}: not a field of this endpoint (the agent refuses fields rather than ignore them)", where
    if first["type"] == "value_error" and not where:  # a model-level check: its message starts with the field
        message = first["msg"].removeprefix("Value error, ")
        return message, message.split(":", 1)[0] if ":" in message else None
    return f"{where}: {first['msg']}", where or None
