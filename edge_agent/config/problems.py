"""A pydantic ``ValidationError`` as ``dotted.path: message`` problems a user can act on: unknown keys
with the closest valid one, literals without internal values."""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from .base import INTERNAL_BACKENDS
from .settings import Settings


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"]).replace(".[", "[")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(str(err["loc"][-1]), _section_keys(err["loc"][:-1]))
        elif err["type"] == "literal_error":
            msg = _literal_message(err)
        problems.append((loc or "(root)", msg))
    return problems


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; this section takes {', '.join(choices)}" if choices else ""


def _section_keys(loc: tuple) -> list[str]:
    """The keys the config section at ``loc`` (e.g. ``("models", "llm", 0)``) accepts."""
    model: type[BaseModel] | None = Settings
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config section class inside an annotation (``TlsConfig | None``, ``list[TierConfig]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _literal_message(err: Any) -> str:
    """``'onnxrt' is not one of 'onnxruntime', …; did you mean 'onnxruntime'?`` without internal values."""
    expected = re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected", "")))
    allowed = [v for v in expected if v not in INTERNAL_BACKENDS]
    if not allowed:
        return err["msg"]
    given = err.get("input")
    hint = _did_you_mean(given, allowed) if isinstance(given, str) else ""
    return f"{given!r} is not one of {', '.join(repr(v) for v in allowed)}" + (hint if "did you" in hint else "")
