"""The words a speech recogniser is told to expect: Whisper's initial prompt, built from a request's tools.

A voice turn knows what it may hear: its tools' descriptions ("Switch a room's light on or off"), their
names (``set_light`` → "set light"), their parameters ("brightness", "minutes") and enum values
("kitchen", "living room"). Whisper, given them as the text that came before (``<|startofprev|>``),
hears those words where the audio leaves it unsure. Then come the operator's ``[asr] prompt_words``
(a Wyoming client sends no tools) and the last turns' words, nearest the utterance, as Whisper keeps
the latest context.

Whisper takes at most 223 prompt tokens; English words are one to three. The tools' part is held to
``TOOL_CHARS`` characters (about 150 tokens) and each enum to ``ENUM_VALUES`` values: a tool list with
a 10,000-value enum keeps its first values and says so in the log once per tool list.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

TOOL_CHARS = 600  # the tools' words, at most (≈150 Whisper tokens)
ENUM_VALUES = 48  # values of one enum, at most
RECENT_CHARS = 160  # the recent turns' words, at most (≈40 tokens)
_told: set[int] = set()  # tool lists whose cut was logged


def _words(name: str) -> str:
    """``set_light`` / ``setLight`` → ``set light``."""
    return " ".join(re.sub(r"([a-z])([A-Z])", r"\1 \2", name).replace("_", " ").replace("-", " ").split()).lower()


def _function(tool: Any) -> dict:
    if not isinstance(tool, dict):
        return {}
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else {}


def tool_words(tools: Sequence[Any] | None) -> tuple[list[str], bool]:
    """The words of ``tools`` (OpenAI function tools), most telling first: descriptions, names, enum values,
    parameter names; and whether anything was left out for length. Malformed parts are skipped."""
    described, names, values, params = [], [], [], []
    cut = False
    for tool in tools or ():
        fn = _function(tool)
        if isinstance(fn.get("description"), str) and fn["description"].strip():
            described.append(" ".join(fn["description"].split())[:200].rstrip("."))
        if isinstance(fn.get("name"), str):
            names.append(_words(fn["name"]))
        props = fn.get("parameters", {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        for key, prop in (props or {}).items() if isinstance(props, dict) else ():
            params.append(_words(str(key)))
            enum = prop.get("enum") if isinstance(prop, dict) else None
            if isinstance(enum, list):
                strings = [" ".join(v.split()) for v in enum if isinstance(v, str) and v.strip()]
                cut |= len(strings) > ENUM_VALUES
                values.extend(strings[:ENUM_VALUES])
    ordered = [*described, *names, *values, *params]
    out, size = [], 0
    for w in dict.fromkeys(ordered):
        if size + len(w) + 2 > TOOL_CHARS:
            cut = True
            break
        out.append(w)
        size += len(w) + 2
    return out, cut


def build_prompt(tools: Sequence[Any] | None = None, words: Iterable[str] = (), recent: Sequence[str] = ()) -> str:
    """The recogniser's context: the operator's ``words``, the tools' words, then the latest ``recent``
    turns (the last one nearest). Empty when there is nothing to say."""
    found, cut = tool_words(tools)
    if cut and id(tools) not in _told:
        _told.add(id(tools))
        names = ", ".join(_words(str(_function(t).get("name", "?"))) for t in (tools or ())[:5])
        log.info(
            "the recogniser's context holds the first words of the tools (%s): the rest (long enums, "
            "descriptions) is left out to stay within Whisper's 224 prompt tokens",
            names,
        )
    parts = [", ".join(w for w in words if w), _sentences(found)]
    tail = " ".join(t.strip() for t in recent if t.strip())[-RECENT_CHARS:]
    if tail:
        parts.append(tail)
    return " ".join(p for p in parts if p).strip()


def _sentences(words: list[str]) -> str:
    """Descriptions as sentences, the other words as one comma-separated list: ``Start a countdown timer.
    set light, kitchen, bedroom.``"""
    long = [w for w in words if " " in w and len(w.split()) > 3]
    short = [w for w in words if w not in long]
    text = " ".join(w[0].upper() + w[1:] + "." for w in long)
    if short:
        text += (" " if text else "") + ", ".join(short) + "."
    return text
