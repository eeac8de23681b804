"""Write a model folder all or nothing, and hash what an import reads.

A staging folder beside the destination is renamed into place when done.

A crash, an exception or Ctrl-C mid-import leaves at most a ``.<name>.importing-*`` folder, which the next
import of the same destination removes; the destination itself is either the old complete folder or the
new complete one. Files are fsynced before the rename, so a power loss cannot leave a renamed folder with
empty files in it. An ``OSError`` on the way (a read-only or full disk, a path through a file) is a
``ModelError`` naming the destination, the file and the reason.

``check_destination`` says, before any work, whether an import may write a destination: a new folder, an
empty one, or an earlier import (a folder with ``import.json``, which is replaced); anything else (a file,
a folder holding other files, a path through a file, a folder that cannot be created) is refused, so an
import never replaces what it did not write. ``check_free_space`` refuses, also before any work, a disk
with less room than the import needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import ModelError

IMPORT_RECORD = "import.json"  # what every import writes last: the mark of a folder an import may replace


def _why(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def is_earlier_import(folder: Path) -> bool:
    """``folder`` holds an ``import.json`` record an import wrote (a JSON object with ``format``)."""
    try:
        record = json.loads((folder / IMPORT_RECORD).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(record, dict) and "format" in record


def check_destination(dest: Path) -> Path:
    """``dest`` as an absolute path an import may write (see the module doc), its parent created; otherwise a
    ``ModelError`` saying why and what is allowed."""
    try:
        dest = Path(dest).expanduser().resolve()
    except (OSError, RuntimeError) as exc:
        raise ModelError(f"{dest}: not a usable destination ({exc})") from exc
    if dest.parent == dest:
        raise ModelError(f"{dest}: not a usable destination (the root of the file system)")
    for above in dest.parents:
        if above.exists():
            if not above.is_dir():
                raise ModelError(f"{dest}: cannot be created: {above} is a file, not a folder")
            break
    if dest.exists() or dest.is_symlink():
        if not dest.is_dir():
            raise ModelError(
                f"{dest}: exists and is not a folder; the destination must be a new or empty folder or an "
                "earlier import (remove it, or choose another path)"
            )
        try:
            entries = sum(1 for _ in dest.iterdir())
        except OSError as exc:
            raise ModelError(f"{dest}: cannot be read ({_why(exc)})") from exc
        if entries and not is_earlier_import(dest):
            raise ModelError(
                f"{dest}: a folder holding {entries} other entr{'y' if entries == 1 else 'ies'}, not an earlier "
                "import; the destination must be a new or empty folder or an earlier import (which is "
                "replaced): remove the folder first to import into it, or choose another path"
            )
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"{dest}: cannot be created ({_why(exc)})") from exc
    if not os.access(dest.parent, os.W_OK | os.X_OK):
        raise ModelError(f"{dest}: cannot be written ({dest.parent} is read-only or not writable)")
    return dest


def check_free_space(dest: Path, need: int) -> None:
    """A ``ModelError`` when the file system holding ``dest`` has fewer than ``need`` bytes free (checked
    before an import writes anything)."""
    free = shutil.disk_usage(dest.parent).free
    if free < need:
        raise ModelError(
            f"{dest.parent}: {free / 2**20:,.0f} MiB free, the imported model needs {need / 2**20:,.0f} MiB"
        )


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_folder(dest: Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder; on a clean exit it becomes ``dest`` (an existing ``dest`` is replaced)."""
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        for stale in dest.parent.glob(f".{dest.name}.importing-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.importing-", dir=dest.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; a model folder is read by the service user too
    except OSError as exc:
        raise ModelError(f"{dest}: cannot be written ({_why(exc)})") from exc
    try:
        yield staging
        _fsync_tree(staging)
        if dest.exists():
            if not replace:
                raise FileExistsError(f"{dest} exists")
            old = dest.parent / f".{dest.name}.importing-old"
            shutil.rmtree(old, ignore_errors=True)
            dest.rename(old)
            staging.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelError(f"{dest}: the folder could not be written ({_why(exc)}); nothing was left behind") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 4 MiB pieces (the pin every fetched and imported source is checked by)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
