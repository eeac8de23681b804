"""Constrained decoding: a per-request token mask from a JSON schema or a grammar (llguidance).

A request that asks for structured output (OpenAI ``response_format``, ``tools``) carries a grammar
in llguidance's JSON form (``json_object_grammar``, ``json_schema_grammar``, ``tool_call_grammar``:
tokenizer-independent text, so the API layer builds it without knowing which tier will answer).
The tier that admits the request binds it to its own tokenizer (``TokenVocab.constraint``); the
scheduler then asks the ``Constraint`` for the allowed tokens before each pick and tells it the
token picked. Whatever the weights say, the output follows the grammar: a random model still
writes valid JSON.

Why llguidance: it builds the mask for a 32k vocabulary in tens of microseconds (a token trie walked
by an Earley parser, compiled lazily, no per-schema precomputation over the vocabulary), has no
dependencies, releases the GIL while it works, and is what several serving stacks use. The
comparison with outlines-core and xgrammar is ``edge-agent bench grammar``.

A grammar that llguidance compiles can still break while it runs (a required self-reference sends
its parser past its item limit on the first token). ``TokenVocab.constraint`` therefore computes the
first mask and takes one allowed token on a copy before the request is admitted, and every later
failure is a ``FormatError`` of that request alone. Its message quotes the first line of
llguidance's error, cut to ``ERROR_CHARS``: the full text carries the parser state and the whole
grammar (megabytes for a schema with a large ``description``).

The JSON it accepts is written compactly and in a fixed shape (``", "`` between items, ``": "``
after keys, properties in schema order), so a tool call always reads ``{"name": "…", "arguments":
{…}}`` and can be streamed as it is generated.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import InputError

# Compact, fixed separators: predictable text (streamable tool calls) and fewer tokens.
JSON_FORMAT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ERROR_CHARS = 200  # what a refusal quotes of llguidance's error: enough to name the problem, never the grammar


class FormatError(InputError):
    """One request's output format cannot be followed: refused before admission, or broken while its
    row generates. It concerns that request alone; its message is short (never the grammar itself)."""


def _problem(matcher: Any) -> str:
    """llguidance's error for ``matcher``: its first line, at most ``ERROR_CHARS`` characters."""
    first = matcher.get_error().strip().split("\n", 1)[0]
    return first if len(first) <= ERROR_CHARS else first[:ERROR_CHARS] + "…"


def _json_grammar(schema: dict[str, Any], what: str) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # llguidance says what it cannot take, e.g. an unsupported keyword
        problem = str(exc)
    if problem:
        raise InputError(f"{what}: the schema is not usable: {problem}", param=what)
    return grammar


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return _json_grammar({"type": "object"}, "response_format")


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format.json_schema.schema") -> str:
    """JSON valid against ``schema`` (``response_format: {"type": "json_schema", ...}``)."""
    if not isinstance(schema, dict):
        raise InputError(f"{param}: must be a JSON Schema object", param=param)
    return _json_grammar(schema, param)


def tool_call_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of one call to any of ``tools`` (OpenAI function tools):
    ``{"name": <declared name>, "arguments": <that tool's parameters>}``."""
    calls = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_grammar(tools: Sequence[dict[str, Any]]) -> str:
    """A grammar whose every sentence is one valid call of one of ``tools``."""
    return _json_grammar(tool_call_schema(tools), "tools")


def tool_or_text_grammar(tools: Sequence[dict[str, Any]]) -> str:
    """``tool_choice: "auto"``: either a valid tool call, or plain text that does not start with ``{``."""
    import llguidance

    call = json.loads(tool_call_grammar(tools))["grammars"][0]
    text = {"name": "text", "lark_grammar": r'start: /[^{\s][\s\S]*/ | ""'}
    root = {"name": "choice", "lark_grammar": "start: @call | @text"}
    call["name"] = "call"
    grammar = json.dumps({"grammars": [root, call, text]})
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:  # a bug in how the grammar is put together, not the caller's fault
        raise RuntimeError(f"tool-or-text grammar refused by llguidance: {problem}")
    return grammar


class Constraint:
    """One request's grammar state on one tier's vocabulary (not thread-safe: one owner at a time)."""

    def __init__(self, vocab: TokenVocab, matcher: Any) -> None:
        self.vocab, self._m = vocab, matcher
        self._words = np.zeros(vocab.mask_words, dtype=np.int32)
        self._first: np.ndarray | None = None  # the first mask, computed by check_start
        self.consumed = 0

    def check_start(self) -> None:
        """Compute the first mask and take one token it allows, on a copy of the matcher: a
        ``FormatError`` here means the grammar cannot even start. The mask is kept for the first
        ``allowed``, so the check costs the device path nothing."""
        first = self.allowed()
        if not first.any():
            raise FormatError("the requested output format allows no first token")
        probe = self._m.deep_copy()
        if not probe.consume_token(int(np.flatnonzero(first)[0])):
            raise FormatError(f"the requested output format breaks on its first token: {_problem(probe)}")
        self._first = first

    def allowed(self) -> np.ndarray:
        """Boolean [n_logits]: the tokens the grammar allows next (EOS once it may end); a
        ``FormatError`` if the grammar broke computing it."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(self._m, self._words[None, :], 0)
        if self._m.is_error():  # llguidance does not raise: it keeps the error and leaves the mask empty
            raise FormatError(f"the requested output format broke after {self.consumed} tokens: {_problem(self._m)}")
        mask = self.vocab.unpack(self._words)
        if self.vocab.other_eos and self.vocab.eos is not None and mask[self.vocab.eos]:
            mask[self.vocab.other_eos] = True  # every stop id ends the output where the format may end
        return mask

    def consume(self, token: int) -> None:
        """Advance past ``token``; a ``FormatError`` if the grammar breaks on it."""
        if not self._m.consume_token(token):
            raise FormatError(
                f"the requested output format broke at token {self.consumed + 1} (id {token}): {_problem(self._m)}"
            )
        self.consumed += 1

    def forced(self) -> list[int]:
        """The tokens the format forces next, whatever the model would say (``{"name": "``, a key, a
        closing brace): none when it leaves a choice. They are not consumed here."""
        tokens = self._m.compute_ff_tokens()
        if self._m.is_error():
            raise FormatError(f"the requested output format broke after {self.consumed} tokens: {_problem(self._m)}")
        return list(tokens)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow (the request ends here)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


class TokenVocab:
    """One tokenizer's vocabulary as llguidance sees it (built once per loaded model, ~10-1000 ms),
    plus exact bytes per token for logprobs."""

    def __init__(
        self, tokenizer_json: str, n_logits: int, eos_ids: Iterable[int], known_ids: int | None = None
    ) -> None:
        """``known_ids``: how many ids the tokenizer itself defines (the model may have more logits)."""
        import llguidance

        eos = sorted(eos_ids)
        # llguidance knows one end token; a model that ends a turn with another of its stop ids (Gemma's
        # <end_of_turn> beside <eos>) may end wherever the format may end (``Constraint.allowed``)
        self.eos, self.other_eos = (eos[0] if eos else None), [e for e in eos[1:] if 0 <= e < n_logits]
        self.n_logits = n_logits
        self.known_ids = n_logits if known_ids is None else min(known_ids, n_logits)
        self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_logits, eos_token=eos[0] if eos else None)
        self.mask_words = (self._tok.vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._bytes: dict[int, bytes] = {}
        self._closers: np.ndarray | None = None

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher for ``grammar``, its first mask computed and its first token tried
        (``Constraint.check_start``): a ``FormatError`` naming what is wrong if it cannot start."""
        import llguidance

        # log_level 0: llguidance would print each failure to stderr itself, unlimited; the scheduler
        # logs one short, rate-limited line instead
        matcher = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise FormatError(f"the requested output format cannot be used: {_problem(matcher)}")
        constraint = Constraint(self, matcher)
        constraint.check_start()
        return constraint

    def unpack(self, words: np.ndarray) -> np.ndarray:
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
        if bits.shape[0] >= self.n_logits:
            return bits[: self.n_logits]
        return np.concatenate([bits, np.zeros(self.n_logits - bits.shape[0], dtype=bool)])

    @property
    def closers(self) -> np.ndarray:
        """Boolean [n_logits]: tokens that hold a character ending a JSON value or string (``"`` ``,``
        ``}`` ``]``). Preferring them, where the grammar allows them, brings an output to its end."""
        with self._lock:
            if self._closers is None:
                marks = set(b'"},]')
                self._closers = np.zeros(self.n_logits, dtype=bool)
                for token in range(self.known_ids):
                    self._closers[token] = not marks.isdisjoint(bytes(self._tok.decode_bytes([token])))
            return self._closers

    def token_bytes(self, token: int) -> bytes:
        """The exact bytes ``token`` stands for (a byte-fallback token is its one byte)."""
        with self._lock:
            got = self._bytes.get(token)
            if got is None:
                known = 0 <= token < self.known_ids
                got = self._bytes[token] = bytes(self._tok.decode_bytes([token])) if known else b""
            return got
