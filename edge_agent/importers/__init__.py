"""Imported formats: a model file in another ecosystem's format becomes an ordinary model folder.

``edge-agent models import SRC`` picks the importer by what SRC is:

- a ``.gguf`` file (llama.cpp's format): ``gguf.import_gguf`` writes a decoder folder in the export
  contract of docs/models.md (``model.onnx`` with KV-cache inputs and outputs, ``config.json``,
  ``tokenizer.json`` built from the file's own vocabulary, ``generation_config.json``);
- a CTranslate2 Whisper folder (faster-whisper's format: ``model.bin`` + ``config.json`` +
  ``vocabulary.*``/``tokenizer.json``): ``ct2_whisper.import_ct2_whisper`` writes a Whisper folder
  (encoder, decoder, decoder with past).

Weights are read and dequantized with numpy (and the ``gguf`` package); neither torch nor the source
runtime is needed. Every importer writes into a staging folder beside the destination and renames it
into place only when complete (``staging.staged_folder``), so a failed import leaves nothing behind.
Imported folders live under ``<models cache>/imported/<name>`` unless ``--out`` says otherwise, and are
then addressable by that name wherever a model is taken. A name is one path component of safe characters
(``result.check_name``); a destination must be new, empty or an earlier import (``staging.check_destination``).
"""

from __future__ import annotations

import stat
from pathlib import Path

from ..errors import ModelError
from .result import ImportResult, ProgressFn, check_name, imported_dir

__all__ = ["ImportResult", "ProgressFn", "detect_format", "import_model", "imported_dir"]


def detect_format(src: Path) -> str:
    """``gguf`` or ``ctranslate2-whisper``; anything else raises ``ModelError`` saying what was expected."""
    src = Path(src)
    try:
        mode = src.stat().st_mode
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise ModelError(f"{src}: no such file or folder") from exc
        raise ModelError(f"{src}: cannot read ({exc.strerror or exc})") from exc
    if stat.S_ISREG(mode):
        try:
            with src.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise ModelError(f"{src}: cannot read ({exc.strerror or exc})") from exc
        if magic == b"GGUF":
            return "gguf"
        raise ModelError(f"{src}: not a GGUF file (it does not start with 'GGUF'); models import takes a .gguf file")
    if stat.S_ISDIR(mode):
        try:
            names = {p.name for p in src.iterdir()}
        except OSError as exc:
            raise ModelError(f"{src}: cannot read ({exc.strerror or exc})") from exc
        if "model.bin" in names and "config.json" in names:
            return "ctranslate2-whisper"
        raise ModelError(
            f"{src}: not a CTranslate2 model folder (no model.bin and config.json); "
            "models import takes a .gguf file or a CTranslate2 Whisper folder"
        )
    raise ModelError(
        f"{src}: not a regular file or a folder (a pipe, a device or a socket); "
        "models import takes a .gguf file or a CTranslate2 Whisper folder"
    )


def import_model(
    src: Path, out: Path | None, cache_dir: Path, name: str | None = None, progress: ProgressFn | None = None
) -> ImportResult:
    """Import ``src`` into ``out`` (default: ``<cache_dir>/imported/<name>``); see the module docstring."""
    src = Path(src).expanduser()
    if name is not None:
        check_name(name)
    fmt = detect_format(src)
    if fmt == "gguf":
        from .gguf import import_gguf

        return import_gguf(src, out, cache_dir, name=name, progress=progress)
    from .ct2_whisper import import_ct2_whisper

    return import_ct2_whisper(src, out, cache_dir, name=name, progress=progress)
