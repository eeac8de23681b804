"""A CTranslate2 ``model.bin`` opened, validated and read as float32 arrays, with errors that name the file.

The layout (CTranslate2's ``specs/model_spec.py``, binary version 6, the one every 4.x writes; 5 is read
too): little-endian ``uint32 version``, ``string spec_name``, ``uint32 revision``, ``uint32 count``, then
per variable ``string name``, ``uint8 rank``, ``uint32 dims[rank]``, ``uint8 dtype``, ``uint32 nbytes``
and the raw bytes; then ``uint32 aliases`` and per alias ``string alias``, ``string target``. A string is
``uint16 length`` (terminator included), the UTF-8 bytes and a NUL.

dtype ids (CTranslate2's ``DataType``): 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16.
Quantized weights (int8, int16) come with a ``<name>_scale`` variable: per output row for int8
(``value * scale`` was rounded, so ``value / scale`` is the weight), one scalar for int16.
``tensor(name)`` returns the dequantized float32 weight, aliases resolved.

What is refused, each as a ``ModelError`` naming the file: another binary version, a truncated file, an
unknown dtype, a missing variable.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelError

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}  # 5: bfloat16 bits
_DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}
SUPPORTED_VERSIONS = (5, 6)
MAX_VARIABLES = 65_536  # Whisper large holds about 1,300; each is read into a record before any check of the set


@dataclass(frozen=True, slots=True)
class Ct2Variable:
    """One stored variable: its name, shape, CTranslate2 dtype name and where its bytes lie."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


class Ct2File:
    """An opened ``model.bin``: ``spec`` and ``revision``, variables by name, ``tensor(name)`` as float32."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelError(f"{self.path}: cannot read ({exc})") from exc
        self._off = 0
        self.variables: dict[str, Ct2Variable] = {}
        self.aliases: dict[str, str] = {}
        version = self._u("I")
        if version not in SUPPORTED_VERSIONS:
            raise ModelError(
                f"{self.path}: CTranslate2 binary version {version} is not supported (supported: {SUPPORTED_VERSIONS})"
            )
        self.version = version
        self.spec = self._s()
        self.revision = self._u("I")
        count = self._u("I")
        if count > MAX_VARIABLES:
            raise ModelError(
                f"{self.path}: the header declares {count:,} variables; at most {MAX_VARIABLES:,} are read"
            )
        for _ in range(count):
            name = self._s()
            rank = self._u("B")
            shape = tuple(self._u("I") for _ in range(rank))
            dtype_id = self._u("B")
            if dtype_id not in _DTYPES:
                raise ModelError(f"{self.path}: variable {name!r} has unknown dtype id {dtype_id}")
            nbytes = self._u("I")
            expected = math.prod(shape) * np.dtype(_DTYPES[dtype_id]).itemsize
            if nbytes != expected:
                raise ModelError(
                    f"{self.path}: variable {name!r} has {nbytes} bytes, its shape {shape} needs {expected}"
                )
            if self._off + nbytes > len(self._buf):
                raise ModelError(f"{self.path}: truncated in variable {name!r} (the file ends before its data)")
            self.variables[name] = Ct2Variable(name, shape, _DTYPE_NAMES[dtype_id], self._off, nbytes)
            self._off += nbytes
        if self._off < len(self._buf):
            aliases = self._u("I")
            if aliases > MAX_VARIABLES:
                raise ModelError(f"{self.path}: the header declares {aliases:,} aliases; at most {MAX_VARIABLES:,}")
            for _ in range(aliases):
                alias = self._s()
                self.aliases[alias] = self._s()

    def _u(self, fmt: str) -> int:
        size = struct.calcsize("<" + fmt)
        if self._off + size > len(self._buf):
            raise ModelError(f"{self.path}: truncated (the header ends at byte {self._off})")
        (value,) = struct.unpack_from("<" + fmt, self._buf.data, self._off)
        self._off += size
        return int(value)

    def _s(self) -> str:
        n = self._u("H")
        if n == 0 or self._off + n > len(self._buf):
            raise ModelError(f"{self.path}: truncated or corrupt (a name at byte {self._off})")
        raw = bytes(self._buf[self._off : self._off + n - 1])
        self._off += n
        return raw.decode("utf-8", errors="replace")

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def has(self, name: str) -> bool:
        return self.resolve(name) in self.variables

    def info(self, name: str) -> Ct2Variable:
        real = self.resolve(name)
        if real not in self.variables:
            raise ModelError(f"{self.path}: no variable {name!r} (is this a {self.spec} of another layout?)")
        return self.variables[real]

    def raw(self, name: str) -> np.ndarray:
        """The stored array as it is (int8 stays int8; bfloat16 is returned as float32)."""
        v = self.info(name)
        dtype_id = next(k for k, n in _DTYPE_NAMES.items() if n == v.dtype)
        arr = np.frombuffer(
            self._buf, _DTYPES[dtype_id], count=v.nbytes // np.dtype(_DTYPES[dtype_id]).itemsize, offset=v.offset
        )
        arr = arr.reshape(v.shape)
        if v.dtype == "bfloat16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr

    def scalar(self, name: str) -> float:
        values = self.raw(name).reshape(-1)
        if values.size == 0:
            raise ModelError(f"{self.path}: variable {name!r} is empty; a scalar was expected")
        return float(values[0])

    def tensor(self, name: str) -> np.ndarray:
        """The variable as float32, dequantized with its ``_scale`` when it is stored as int8/int16."""
        v = self.info(name)
        arr = self.raw(name)
        if v.dtype in ("int8", "int16"):
            scale_name = f"{name}_scale"
            if not self.has(scale_name):
                return arr.astype(np.float32)  # a plain integer variable (flags, ids)
            scale = self.raw(scale_name).astype(np.float32)
            flat = arr.reshape(arr.shape[0], -1).astype(np.float32)
            scale = scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(1, 1)
            return (flat / scale).reshape(arr.shape).astype(np.float32)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def dtypes(self) -> dict[str, int]:
        """How many weight variables are stored per dtype (what the import summary reports)."""
        out: dict[str, int] = {}
        for v in self.variables.values():
            if v.shape and not v.name.endswith("_scale"):
                out[v.dtype] = out.get(v.dtype, 0) + 1
        return out
