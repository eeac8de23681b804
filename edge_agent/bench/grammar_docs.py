"""The grammars of ``bench grammar`` and documents that satisfy them, token by token.

Two grammars: ``tool-call`` (a tool call as the API constrains one: ``name`` from an enum of three tools, typed
``arguments`` with a string of bounded length, a number, a boolean, an array and a nested object) and
``json_object`` (any JSON object, OpenAI's ``response_format: json_object``). ``documents`` generates
schema-valid documents from a seeded RNG (ASCII text, properties in schema order, nesting within what a regex
engine unrolls) and tokenizes each as a model's continuation, so every benchmark walk follows a real
generation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from .vocab32k import continuation_ids

TOOLS = ("get_weather", "search_web", "set_timer")

TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"enum": list(TOOLS)},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 64},
                "limit": {"type": "number"},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}},
                "where": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 32},
                        "lat": {"type": "number"},
                        "lon": {"type": "number"},
                    },
                    "required": ["city", "lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["query", "limit", "exact", "tags", "where"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

SCHEMAS: dict[str, dict[str, Any]] = {"tool-call": TOOL_CALL_SCHEMA, "json_object": JSON_OBJECT_SCHEMA}

WORDS = (
    "weather forecast paris berlin tokyo lagoon timer kitchen search news model edge device battery sensor "
    "tomorrow morning evening rain wind offline cache status report alarm light door garden voltage "
    "temperature humidity route traffic station meeting summary"
).split()
CITIES = ("Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Austin", "Pune")


def _words(rng: random.Random, n_max: int, max_chars: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n_max)))
    return text[:max_chars].rstrip()


def tool_call_doc(rng: random.Random) -> dict[str, Any]:
    """A tool call valid under ``TOOL_CALL_SCHEMA``."""
    return {
        "name": rng.choice(TOOLS),
        "arguments": {
            "query": _words(rng, 8, 64),
            "limit": rng.choice([rng.randint(1, 50), round(rng.uniform(0, 100), 2)]),
            "exact": rng.random() < 0.5,
            "tags": [_words(rng, 2, 16) for _ in range(rng.randint(0, 4))],
            "where": {
                "city": rng.choice(CITIES),
                "lat": round(rng.uniform(-90, 90), 4),
                "lon": round(rng.uniform(-180, 180), 4),
            },
        },
    }


def _value(rng: random.Random, depth: int) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "obj"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return _words(rng, 5, 48)
    if kind == "int":
        return rng.randint(-1000, 100_000)
    if kind == "float":
        return round(rng.uniform(-1e3, 1e3), 3)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(WORDS, rng.randint(1, 5))
    return {k: _value(rng, depth) for k in keys}


def json_object_doc(rng: random.Random) -> dict[str, Any]:
    """A JSON object, at most two containers deep below the root (outlines-core unrolls three levels)."""
    return _object(rng, 0)


GENERATORS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "tool-call": tool_call_doc,
    "json_object": json_object_doc,
}


def documents(grammar: str, tokenizer, min_tokens: int, seed: int) -> list[list[int]]:
    """Token ids of schema-valid documents for ``grammar``, generated from ``seed`` until they hold at least
    ``min_tokens`` tokens in all (each document tokenized as a model's continuation)."""
    rng = random.Random(f"{grammar}:{seed}")
    out: list[list[int]] = []
    total = 0
    while total < min_tokens:
        text = json.dumps(GENERATORS[grammar](rng))
        ids = continuation_ids(tokenizer, text)
        out.append(ids)
        total += len(ids)
    return out
