"""Whether a transcript names a whole command for a set of tools: the voice turn's end-of-turn check.

A spoken command is whole when, for at least one tool, every required parameter has a value in its
words: an ``enum`` parameter one of its values (as words: "living room"), an ``integer`` / ``number``
parameter a number (digits, or English number words: "twenty one"), a ``boolean`` one a word that says
yes or no ("on", "off", "enable", ...). "turn on the" or "make the kitchen" (no temperature) is not whole
for the home tools; "make the kitchen twenty degrees" is.

A free ``string`` parameter cannot be told from the words, and a tool without required parameters needs
none: such a tool would make every utterance whole. So the answer has three values: ``True``, whole
with at least one required value heard in the words; ``False``, no tool is whole; ``None``, whole only
for tools whose required values cannot be heard, so the words cannot tell (the end of turn then goes by
the recogniser's language model alone, as without tools).

The check is deliberately about the words only (no model), so it costs microseconds on every silent
frame the endpointer asks it about (``AsrService.end_silence_ms``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand "
    "half dozen".split()
)
BOOLEAN_WORDS = frozenset("on off yes no true false enable disable enabled disabled open close start stop".split())


def _words(text: str) -> str:
    return " " + " ".join(re.findall(r"[a-z0-9]+", text.lower())) + " "


def _audible(schema: dict[str, Any]) -> bool:
    """Whether a value of this parameter can be heard in words (an enum, a number, a yes/no)."""
    return "enum" in schema or schema.get("type") in ("integer", "number", "boolean")


def _has_value(words: str, schema: dict[str, Any]) -> bool:
    if "enum" in schema:
        return any(f" {' '.join(re.findall(r'[a-z0-9]+', str(v).lower()))} " in words for v in schema["enum"])
    kind = schema.get("type")
    tokens = words.split()
    if kind in ("integer", "number"):
        return any(t.isdigit() or t in NUMBER_WORDS for t in tokens)
    if kind == "boolean":
        return any(t in BOOLEAN_WORDS for t in tokens)
    return True  # a free string (or a shape the words cannot show): not held against the command


def names_a_command(text: str, tools: Sequence[dict]) -> bool | None:
    """Whether ``text`` gives every required parameter of at least one of ``tools`` (OpenAI function
    tools) a value: True (with a value heard), False, or None (only vacuously; see the module doc)."""
    words = _words(text)
    if not words.strip():
        return False
    vacuous = False
    for tool in tools:
        params = tool.get("function", tool).get("parameters") or {}
        props = params.get("properties") or {}
        required = [props.get(name) or {} for name in params.get("required") or []]
        if all(_has_value(words, schema) for schema in required):
            if any(_audible(schema) for schema in required):
                return True
            vacuous = True
    return None if vacuous else False


def command_check(tools: Sequence[dict] | None) -> Callable[[str], bool | None] | None:
    """The check for a voice turn's stream (``open_stream(complete=...)``): None without tools (a words
    reply has no command to be whole)."""
    if not tools:
        return None
    return lambda text: names_a_command(text, tools)
