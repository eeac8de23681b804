"""What an import returns, and where imported models live by default."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..models.catalog import IMPORTED

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
