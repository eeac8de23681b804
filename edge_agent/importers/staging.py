"""Write a model folder all or nothing, and hash what an import reads.

A staging folder beside the destination is renamed into place when done.

A crash, an exception or Ctrl-C mid-import leaves at most a ``.<name>.importing-*`` folder, which the next
import of the same destination removes; the destination itself is either the old complete folder or the
new complete one. Files are fsynced before the rename, so a power loss cannot leave a renamed folder with
empty files in it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.importing-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.importing-", dir=dest.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model folder is read by the service user too
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
