"""Synthesised calibration audio, made on first use.

The shipped ASR manifests (``calibration/asr/*.jsonl``) carry, per line, the recipe its WAV is made
from (``"synth"``): the espeak-ng training synthesiser's, or one naming a voice engine (Piper, flite,
espeak-ng: ``engines/voices.py``, the natural-voice sets ``voices-*.jsonl``); the WAVs themselves
(40 MB) are neither committed nor shipped. When a
build needs them and they are missing, they are synthesised here with the same code as
``scripts/asr-eval-audio`` (``scripts/train_asr/synth.py``, shipped with the package): next to the
manifest when it is the user's or a checkout's, else (the package's own, read-only under systemd)
into ``<cache>/calibration/`` beside a copy of the manifest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

from ..errors import InputError
from ..progress import Progress
from ..shipped import calibration_dir, is_packaged, synth_script
from .voices import from_recipe, is_voice_recipe, pad, synthesize

log = logging.getLogger(__name__)

TOOLS = ("espeak-ng", "sox")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def home_for(manifest: Path) -> Path:
    """Where the manifest's synthesised WAVs live: beside it, or for the package's own (and any
    read-only folder) beside a copy under the cache."""
    from ..config import default_cache_dir

    manifest = manifest.resolve()
    if not is_packaged(manifest) and os.access(manifest.parent, os.W_OK):
        return manifest
    try:
        relative = manifest.relative_to(calibration_dir().resolve())
    except ValueError:  # someone else's read-only folder: keyed by where it is
        relative = Path(hashlib.sha256(str(manifest.parent).encode()).hexdigest()[:12]) / manifest.name
    return default_cache_dir() / "calibration" / relative


def materialise(manifest: Path, records: list[tuple[int, dict]]) -> Path:
    """The manifest to read ``records`` (its parsed lines) from so that every audio file exists:
    ``manifest`` itself, or its synthesised home. Records without a ``synth`` recipe are left alone
    (the caller reports their missing files)."""
    todo = [
        (n, item)
        for n, item in records
        if isinstance(item.get("synth"), dict)
        and isinstance(item.get("audio"), str)
        and not (manifest.parent / item["audio"]).is_file()
    ]
    if not todo:
        return manifest
    home = home_for(manifest)
    if home != manifest.resolve():
        if not home.is_file() or home.read_bytes() != manifest.read_bytes():
            home.parent.mkdir(parents=True, exist_ok=True)
            tmp = home.with_suffix(".tmp")
            tmp.write_bytes(manifest.read_bytes())
            tmp.replace(home)  # a new manifest version: its WAVs are rewritten below only where missing
        todo = [(n, item) for n, item in todo if not (home.parent / item["audio"]).is_file()]
        if not todo:
            return home
    natural = [(n, item) for n, item in todo if is_voice_recipe(item["synth"])]
    if natural:
        _voices(manifest, home, natural)
        todo = [(n, item) for n, item in todo if not is_voice_recipe(item["synth"])]
        if not todo:
            return home
    missing = missing_tools()
    if missing:
        raise InputError(
            f"{manifest}: {len(todo)} audio files are synthesised from the manifest's espeak-ng "
            f"recipes, which needs {' and '.join(missing)} (not found on PATH): "
            f"apt install espeak-ng sox, or put recorded WAVs at the manifest's paths"
        )
    synth = _synth_module()
    print(
        f"synthesising {len(todo)} WAVs of {manifest.name} with espeak-ng into {home.parent} "
        f"(once; about {max(1, len(todo) // 25)} s)",
        file=sys.stderr,
        flush=True,
    )
    with Progress(f"synthesising {manifest.name}", "WAVs") as bar:
        for done, (number, item) in enumerate(todo, 1):
            try:
                samples = synth.render(item["text"], synth.recipe_from_dict(item["synth"]))
            except (RuntimeError, TypeError, KeyError) as exc:
                raise InputError(f"{manifest}:{number}: cannot synthesise {item['audio']}: {exc}") from exc
            out = home.parent / item["audio"]
            synth.write_wav(out.with_suffix(".tmp.wav"), samples)
            out.with_suffix(".tmp.wav").replace(out)  # an interrupted run leaves no truncated WAV behind
            bar.update(done, len(todo))
    log.info("synthesised %d WAVs for %s into %s", len(todo), manifest, home.parent)
    return home


def _voices(manifest: Path, home: Path, todo: list[tuple[int, dict]]) -> None:
    """The lines whose recipe names a voice engine (Piper, flite, espeak-ng: ``engines/voices.py``)."""
    recipes = []
    for number, item in todo:
        try:
            recipes.append(from_recipe(item["synth"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{manifest}:{number}: a malformed voice recipe for {item['audio']} ({exc})") from None
    voices = sorted({v for v, _, _ in recipes}, key=lambda v: v.spec)
    print(
        f"synthesising {len(todo)} WAVs of {manifest.name} ({', '.join(v.label for v in voices)}) into "
        f"{home.parent} (once)",
        file=sys.stderr,
        flush=True,
    )
    with Progress(f"synthesising {manifest.name}", "WAVs") as bar:
        try:
            spoken = synthesize([(item["text"], v) for (_, item), (v, _, _) in zip(todo, recipes)], bar.update)
        except RuntimeError as exc:
            raise InputError(f"{manifest}: {exc}") from None
    from ..audio.wav import write_wav

    for (_, item), (_, lead, tail), samples in zip(todo, recipes, spoken):
        out = home.parent / item["audio"]
        out.parent.mkdir(parents=True, exist_ok=True)
        write_wav(out.with_suffix(".tmp.wav"), pad(samples, lead, tail))
        out.with_suffix(".tmp.wav").replace(out)
    log.info("synthesised %d WAVs for %s into %s", len(todo), manifest, home.parent)


def _synth_module() -> ModuleType:
    path = synth_script()
    if not path.is_file():
        raise InputError(f"{path}: the speech synthesiser is not installed with this edge-agent (reinstall it)")
    name = "edge_agent_synth"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"{path}: the speech synthesiser cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def materialise_file(manifest: Path) -> Path:
    """Every missing WAV of ``manifest`` synthesised (scripts/asr-eval-audio for the voice sets)."""
    import json

    records = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise InputError(f"{manifest}:{number}: not valid JSON ({exc.msg})") from None
    return materialise(manifest, records)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(materialise_file(Path(arg)))
