"""What an import returns, and where imported models live by default."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..models.catalog import IMPORTED

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")

ProgressFn = Callable[[int, int], None]  # (done, total) in the importer's own unit


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import wrote: the folder, the name it is addressable by, the source format, a summary."""

    name: str
    path: Path
    source_format: str  # "gguf" | "ctranslate2-whisper"
    architecture: str  # e.g. "gemma3", "whisper"
    details: dict


def imported_dir(cache_dir: Path) -> Path:
    """Where imported models live by default: addressable by their folder's name."""
    return Path(cache_dir) / IMPORTED


def check_name(name: str) -> str:
    """``name`` when it is one path component of safe characters (what ``--model NAME`` finds under the
    imported folder), else a ``ModelError`` saying what a name may be."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:60] + "…"
        raise ModelError(
            f"model name {shown} is not allowed: a name is one path component of letters, digits, '.', '_' "
            "and '-', at most 100 characters, starting with a letter or digit"
        )
    return name
