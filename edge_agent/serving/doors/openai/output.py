"""From an OpenAI request to what the scheduler runs, and from its tokens back to OpenAI's shapes.

- ``plan``: the sampling parameters (with the output-format grammar for ``response_format`` and
  ``tools``) and the chat messages, the tools described to the model in words it can follow.
- ``ToolCallStream``: a tool call is generated as ``{"name": "…", "arguments": {…}}`` (the grammar
  fixes that shape); it is turned into OpenAI's ``tool_calls`` deltas while it is written, the
  name as soon as it is complete, then the arguments piece by piece.
- ``chat_logprobs`` / ``completion_logprobs``, ``timings`` and ``server_timing``: the per-token and
  per-request figures in OpenAI's and llama.cpp's shapes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....errors import InputError
from ....metrics.timing import RequestTiming
from ....models import grammar
from ....models.sampling import SamplingParams
from ....models.tokenizer import Message
from ...llm.handle import RequestHandle, TokenLogprob
from .schema import ChatRequest, CompletionRequest, GenerateRequest, NamedToolChoice, Tool

DEFAULT_MAX_TOKENS = 256
_CALL_HEAD = '{"name": "'
_ARGS_HEAD = '", "arguments": '


@dataclass(frozen=True, slots=True)
class Plan:
    """What to run for one request: sampling (grammar included), the prompt, and whether the output is
    a tool call (``"required"``), may be one (``"auto"``), or is plain text (``None``)."""

    params: SamplingParams
    prompt: str | list[Message]
    tools: str | None = None


def plan(body: GenerateRequest) -> Plan:
    """The sampling parameters and prompt for ``body`` (an ``InputError`` naming the field if unusable)."""
    fmt: str | None = None
    tools_mode: str | None = None
    prompt: str | list[Message]
    if isinstance(body, ChatRequest):
        declared = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        choice = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            declared = [t for t in declared if t["function"]["name"] == choice.function["name"]]
            choice = "required"
        if declared and choice != "none":
            tools_mode = choice or "auto"
            fmt = (
                grammar.tool_call_grammar(declared)
                if tools_mode == "required"
                else grammar.tool_or_text_grammar(declared)
            )
        elif body.response_format is not None and body.response_format.type == "json_object":
            fmt = grammar.json_object_grammar()
        elif body.response_format is not None and body.response_format.type == "json_schema":
            assert body.response_format.json_schema is not None  # the schema checked it
            fmt = grammar.json_schema_grammar(body.response_format.json_schema.schema_)
        prompt = messages(body, declared if tools_mode else [], tools_mode)
    else:
        assert isinstance(body, CompletionRequest)
        prompt = body.prompt
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = SamplingParams(
        max_new_tokens=body.requested_max_tokens or DEFAULT_MAX_TOKENS,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=body.bias(),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logprobs=body.top_n if isinstance(body, (ChatRequest, CompletionRequest)) else None,
        grammar=fmt,
    )
    return Plan(params, prompt, tools_mode)


def messages(body: ChatRequest, tools: Sequence[dict], mode: str | None) -> list[Message]:
    """The chat as the model's template takes it: ``developer`` is ``system``, a tool result is a user
    turn that says whose result it is, an assistant's earlier calls are the JSON it wrote, and the
    tools are described at the end of the last user turn (every chat template has user turns)."""
    out: list[Message] = []
    names = {}
    for m in body.messages:
        for call in m.tool_calls or ():
            fn = call.get("function") or {}
            names[call.get("id")] = fn.get("name")
        if m.role == "tool":
            who = names.get(m.tool_call_id) or m.name or "the tool"
            out.append(Message("user", f"Result of {who}: {m.text()}"))
        elif m.role == "assistant" and m.tool_calls:
            calls = [
                _call_text((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in m.tool_calls
            ]
            out.append(Message("assistant", (m.text() + "\n" if m.text() else "") + "\n".join(calls)))
        else:
            out.append(Message("system" if m.role == "developer" else m.role, m.text()))
    return with_tools(out, tools, mode) if tools else out


def with_tools(chat: list[Message], tools: Sequence[dict], mode: str | None = "required") -> list[Message]:
    """``chat`` with ``tools`` described at the start of its first user turn (every chat template has
    user turns; not all take a system turn). There they are the same prompt prefix for every request and
    every turn of a conversation with the same tools, which the prefix KV cache prefills once."""
    lines = [
        "You can call these tools:",
        *(
            json.dumps(
                {k: t["function"][k] for k in ("name", "description", "parameters") if k in t["function"]},
                separators=(",", ":"),
            )
            for t in tools
        ),
        'To call one, reply with only {"name": <tool name>, "arguments": <its arguments>}'
        + ("." if mode == "required" else "; otherwise answer in words."),
    ]
    out = list(chat)
    first = next((i for i, m in enumerate(out) if m.role == "user"), None)
    if first is None:
        out.append(Message("user", "\n".join(lines)))
    else:
        out[first] = Message("user", "\n".join(lines) + "\n\n" + out[first].content)
    return out


def load_tools(path: str | Path) -> list[dict]:
    """OpenAI function tools from a JSON file (a list, or ``{"tools": [...]}``), checked like the API's."""

    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InputError(f"{where}: cannot read the tools file ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not JSON (line {exc.lineno}: {exc.msg})") from exc
    return parse_tools(data, where)


def parse_tools(data: Any, where: str) -> list[dict]:
    """OpenAI function tools from decoded JSON (a list, or ``{"tools": [...]}``), checked like the API's;
    an ``InputError`` naming ``where`` and the field."""
    from pydantic import ValidationError

    items = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise InputError(f'{where}: expected a list of tools, or {{"tools": [...]}}')
    tools = []
    for i, item in enumerate(items):
        try:
            tools.append(Tool.model_validate(item, strict=False).model_dump(exclude_none=True))
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            at = ".".join(str(x) for x in first["loc"])
            raise InputError(f"{where}: tools[{i}].{at}: {first['msg']}") from exc
    grammar.tool_call_grammar(tools)  # a parameters schema the grammar engine cannot use is refused here
    return tools


def _call_text(name: Any, arguments: Any) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
    return f'{{"name": {json.dumps(name)}, "arguments": {args}}}'


def tool_call(text: str, call_id: str | None = None) -> dict | None:
    """OpenAI's ``tool_calls`` entry for a complete generated call, or None if ``text`` is not one."""
    if not text.startswith(_CALL_HEAD):
        return None
    try:
        call = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None  # cut short (max_tokens), or nested deeper than the parser reads: no call was made
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
    }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Streams one generated tool call as OpenAI ``delta.tool_calls`` entries (or plain text when
    ``tool_choice`` is ``auto`` and the model answered in words)."""

    def __init__(self) -> None:
        self.id = new_call_id()
        self.text = ""
        self.kind: str | None = None  # "call" | "text", once the first characters tell
        self._sent = 0  # characters of the arguments already sent
        self._named = False

    def push(self, piece: str) -> list[dict]:
        """Deltas for ``piece``: [{"content": …}] for text, [{"tool_calls": […]}] for a call."""
        self.text += piece
        if self.kind is None:
            if not self.text:
                return []
            if _CALL_HEAD.startswith(self.text[: len(_CALL_HEAD)]) and len(self.text) < len(_CALL_HEAD):
                return []  # could still become a call
            self.kind = "call" if self.text.startswith(_CALL_HEAD) else "text"
            if self.kind == "text":
                return [{"content": self.text}]
        if self.kind == "text":
            return [{"content": piece}] if piece else []
        return self._call_deltas(final=False)

    def finish(self) -> list[dict]:
        """What is left once the generation ended (the arguments' last characters)."""
        if self.kind is None and self.text:
            # only a call starts with "{" (the text branch of tool_choice "auto" cannot): cut off
            # (max_tokens) before its name was complete, it is still reported as a call
            self.kind = "call" if self.text.startswith("{") else "text"
            if self.kind == "text":
                return [{"content": self.text}]
        return self._call_deltas(final=True) if self.kind == "call" else []

    def _call_deltas(self, final: bool) -> list[dict]:
        out = []
        body = self.text[len(_CALL_HEAD) :]
        end = body.find(_ARGS_HEAD)
        if not self._named:
            if end < 0 and not final:
                return []
            self._named = True
            # tool names are [A-Za-z0-9_-] (schema.ToolFunction): no escapes, the first '"' ends one;
            # cut off (max_tokens) inside the name, the call is still reported, with the part written
            name = body[:end] if end >= 0 else body.split('"', 1)[0]
            out.append({"index": 0, "id": self.id, "type": "function", "function": {"name": name, "arguments": ""}})
        if end < 0:
            return [{"tool_calls": [d]} for d in out]
        args = body[end + len(_ARGS_HEAD) :]
        # a finished call's last "}" closes the wrapper, not the arguments; a cut-off one has no such "}"
        complete = final and _parses(self.text)
        usable = len(args) - 1 if complete else len(args) - (0 if final else 1)
        piece = args[self._sent : max(self._sent, usable)]
        self._sent = max(self._sent, usable)
        if piece:
            out.append({"index": 0, "function": {"arguments": piece}})
        return [{"tool_calls": [d]} for d in out]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def split_tool_call(text: str) -> tuple[str | None, dict | None, bool]:
    """``(content, tool_calls entry, complete)`` for a whole generation in tools mode: the call as the
    stream sends it (``ToolCallStream``), so both shapes agree. A call cut off by ``max_tokens`` is
    still a call, its ``arguments`` the unfinished JSON written so far (``complete`` False); words
    are ``(text, None, False)``."""
    call = tool_call(text)
    if call is not None:
        return None, call, True
    stream = ToolCallStream()
    deltas = stream.push(text) + stream.finish()
    if stream.kind != "call":
        return text, None, False
    fn = {"name": "", "arguments": ""}
    for delta in deltas:
        for entry in delta["tool_calls"]:
            fn["name"] = entry["function"].get("name", fn["name"])
            fn["arguments"] += entry["function"]["arguments"]
    return None, {"id": stream.id, "type": "function", "function": fn}, False


def _token_entry(token_bytes: bytes, logprob: float) -> dict:
    return {
        "token": token_bytes.decode("utf-8", errors="backslashreplace"),
        "logprob": logprob,
        "bytes": list(token_bytes),
    }


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of a chat completion: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {
        "content": [
            {**_token_entry(i.token_bytes, i.logprob), "top_logprobs": [_token_entry(b, lp) for _t, b, lp in i.top]}
            for i in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[TokenLogprob], offset: int = 0) -> dict:
    """``choices[].logprobs`` of a (legacy) completion: parallel lists and text offsets."""
    tokens, offsets, at = [], [], offset
    for i in items:
        text = i.token_bytes.decode("utf-8", errors="backslashreplace")
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [i.logprob for i in items],
        "top_logprobs": [{b.decode("utf-8", errors="backslashreplace"): lp for _t, b, lp in i.top} for i in items],
        "text_offset": offsets,
    }


def usage(prompt: RequestTiming, completion_tokens: int) -> dict[str, Any]:
    """``usage`` of a reply whose prompt's timeline is ``prompt`` (the prompt counts once however many choices
    were drawn from it): OpenAI's token counts, with the prompt tokens the prefix cache gave in
    ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt.tokens_in,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt.tokens_in + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens},
    }


def timings(handle: RequestHandle, timing: RequestTiming, requested_max_tokens: int | None) -> dict:
    """Per-request figures, the same the daemon's metrics record for this request (milliseconds)."""
    decode_s = (timing.token_times_s[-1] - timing.token_times_s[0]) if len(timing.token_times_s) > 1 else 0.0
    out: dict[str, Any] = {
        "queue_ms": _ms(timing.queue_ms),
        "prefill_ms": _ms(timing.prefill_ms),
        "ttft_ms": _ms(timing.ttft_ms),
        "e2e_ms": _ms(timing.e2e_ms),
        "prompt_tokens": timing.tokens_in,
        "cached_tokens": timing.cached_tokens,
        "completion_tokens": timing.tokens_out,
        "decode_tokens_per_s": round((timing.tokens_out - 1) / decode_s, 2) if decode_s > 0 else None,
        "tier": handle.tier,
        "model": handle.model,
        "engine": handle.engine,
    }
    if _clamped(handle, requested_max_tokens):
        out["max_tokens"] = {"requested": requested_max_tokens, "granted": handle.max_new_tokens}
    if handle.spill is not None:  # served by the tier beside a one-sequence tier, and why
        out["spilled"] = dict(handle.spill)
    return out


def _clamped(handle: RequestHandle, requested_max_tokens: int | None) -> bool:
    """Whether the tier's cap granted fewer tokens than the request asked for."""
    granted = handle.max_new_tokens
    return bool(requested_max_tokens) and granted is not None and granted < (requested_max_tokens or 0)


def clamp_warning(handle: RequestHandle, requested_max_tokens: int | None) -> str | None:
    if not _clamped(handle, requested_max_tokens):
        return None
    return (
        f"max_tokens {requested_max_tokens} is above tier {handle.tier!r}'s cap: "
        f"at most {handle.max_new_tokens} tokens are generated"
    )


def server_timing(t: dict) -> str:
    """The ``Server-Timing`` header for ``timings(...)``."""
    parts = [
        f"{name};dur={t[f'{name}_ms']}"
        for name in ("queue", "prefill", "ttft", "e2e")
        if t.get(f"{name}_ms") is not None
    ]
    return ", ".join(parts)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
