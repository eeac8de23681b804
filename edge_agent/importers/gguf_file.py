"""A GGUF file opened, validated and read as float32 arrays, with errors that name the file and the fault.

GGUF (llama.cpp's format, v2/v3): a header, key/value metadata (``general.architecture``,
``<arch>.block_count``, ``tokenizer.ggml.tokens`` …), tensor infos, then aligned tensor data. The header
is walked here, memory-mapped, with every declared count and length checked against the bytes left
before anything is read or allocated, so a file of a few bytes cannot declare its way into gigabytes or
minutes: numeric arrays stay views into the file, string arrays are indexed (at most ``MAX_STRINGS``
items each) and decoded only when read. The ``gguf`` package dequantizes every block type llama.cpp
writes (Q4_0 … Q8_0, the K-quants, IQ*) with numpy. Shapes come out the way llama.cpp's converters
store them: ``[out, in]`` for a linear weight (PyTorch's layout), ``[vocab, hidden]`` for the embedding.

What is refused, each as a ``ModelError`` naming the file: not a regular file, not a GGUF, another GGUF
version, a truncated or corrupt file (a count or length past the end, tensor data past the end, a block
type GGUF does not define), more than ``MAX_KEYS`` keys or ``MAX_TENSORS`` tensors, a block type this
``gguf`` cannot dequantize, a missing tensor or metadata key, and (``integer``, ``number``) a metadata
value of the wrong kind or outside its range, naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
import mmap
import stat
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, ModelError

VERSIONS = (2, 3)
MAX_KEYS = 65_536  # real files hold a few dozen
MAX_TENSORS = 65_536  # real files hold a few hundred to a few thousand
MAX_STRINGS = 1 << 21  # items of one string array: 8 times the largest vocabulary (Gemma's 262,144)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_WIDTH = 1 << 20  # hidden size, FFN width, heads, head size: far above any decoder's
MAX_CONTEXT = 1 << 24  # positions (16,777,216): above the longest context any GGUF declares
STRING, ARRAY = 8, 9
_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # a core dependency; only a broken install gets here
        raise BackendUnavailable("reading GGUF files needs the 'gguf' package: pip install gguf") from exc
    return gguf


def show(value: object, limit: int = 60) -> str:
    """A metadata value for a message: its repr, clipped to about ``limit`` characters."""
    if isinstance(value, np.ndarray):
        value = value[:8].tolist() + (["…"] if value.size > 8 else [])
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file: its name, numpy shape (rows first) and block type."""

    name: str
    shape: tuple[int, ...]
    block_type: str  # F32, F16, Q8_0, Q4_K, …


@dataclass(frozen=True, slots=True)
class _Tensor:
    info: TensorInfo
    qtype: int
    offset: int  # absolute, in the file
    nbytes: int
    row_bytes: int  # of one row (the innermost dimension)


class _Strings:
    """A string array of the file: where each item lies, decoded on request."""

    def __init__(self, starts: array, lengths: array) -> None:
        self.starts, self.lengths = starts, lengths

    def __len__(self) -> int:
        return len(self.starts)


class GgufFile:
    """An opened GGUF: metadata values by key, tensor infos by name, ``tensor(name)`` as float32."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ModelError(f"{self.path}: not a regular file; models import takes a .gguf file")
            with self.path.open("rb") as fh:
                magic = fh.read(4)
                if magic != b"GGUF":
                    raise ModelError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        except ValueError as exc:  # mmap of a file that shrank to nothing
            raise ModelError(f"{self.path}: cannot read ({exc})") from exc
        self._size = len(self._mm)
        self._off = 4
        self._fields: dict[str, Any] = {}
        self._tensors: dict[str, _Tensor] = {}
        self._read_header()

    # -- the header, walked with bounds ----------------------------------------------------------

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self._off + n > self._size:
            raise ModelError(
                f"{self.path}: truncated or corrupt: {what} needs {n:,} bytes at byte {self._off:,}, "
                f"the file has {self._size:,}"
            )

    def _u32(self, what: str) -> int:
        self._need(4, what)
        (v,) = _U32.unpack_from(self._mm, self._off)
        self._off += 4
        return int(v)

    def _u64(self, what: str) -> int:
        self._need(8, what)
        (v,) = _U64.unpack_from(self._mm, self._off)
        self._off += 8
        return int(v)

    def _str(self, what: str) -> str:
        n = self._u64(what)
        self._need(n, what)
        raw = self._mm[self._off : self._off + n]
        self._off += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelError(f"{self.path}: {what} is not UTF-8 text (at byte {self._off - n:,})") from exc

    def _read_header(self) -> None:
        self.version = self._u32("the version")
        if self.version not in VERSIONS:
            raise ModelError(f"{self.path}: GGUF version {self.version} is not supported (supported: 2, 3)")
        n_tensors, n_keys = self._u64("the tensor count"), self._u64("the key count")
        for count, most, what in ((n_keys, MAX_KEYS, "metadata keys"), (n_tensors, MAX_TENSORS, "tensors")):
            if count > most:
                raise ModelError(f"{self.path}: the header declares {count:,} {what}; at most {most:,} are read")
        for i in range(n_keys):
            key = self._str(f"metadata key {i}")
            if key in self._fields:
                raise ModelError(f"{self.path}: metadata key {show(key)} appears twice")
            self._fields[key] = self._value(key, self._u32(f"the type of {show(key)}"))
        gguf = _gguf()
        infos, names = [], set()
        for i in range(n_tensors):
            name = self._str(f"tensor name {i}")
            n_dims = self._u32(f"the dimension count of tensor {show(name)}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelError(f"{self.path}: tensor {show(name)} has {n_dims} dimensions; 1..{MAX_DIMS} are allowed")
            dims = [self._u64(f"the shape of tensor {show(name)}") for _ in range(n_dims)]
            qtype = self._u32(f"the block type of tensor {show(name)}")
            offset = self._u64(f"the data offset of tensor {show(name)}")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
                type_name = gguf.GGMLQuantizationType(qtype).name
            except (ValueError, KeyError) as exc:
                raise ModelError(
                    f"{self.path}: tensor {show(name)} has block type id {qtype}, not one GGUF defines"
                ) from exc
            if dims[0] % block:
                raise ModelError(
                    f"{self.path}: tensor {show(name)}'s rows of {dims[0]} values are not whole {type_name} blocks"
                )
            row_bytes = dims[0] // block * type_size
            if name in names:
                raise ModelError(f"{self.path}: tensor {show(name)} appears twice")
            names.add(name)
            infos.append((TensorInfo(name, tuple(reversed(dims)), type_name), qtype, offset, row_bytes))
        alignment = self._fields.get("general.alignment", 32)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise ModelError(f"{self.path}: general.alignment is {show(alignment)}; it must be a power of two")
        start = -(-self._off // alignment) * alignment
        for info, qtype, offset, row_bytes in infos:
            nbytes = row_bytes * math.prod(info.shape[:-1])
            end = start + offset + nbytes
            if end > self._size:
                raise ModelError(
                    f"{self.path}: truncated: tensor {show(info.name)} ends at byte {end:,}, "
                    f"the file has {self._size:,}"
                )
            self._tensors[info.name] = _Tensor(info, qtype, start + offset, nbytes, row_bytes)

    def _value(self, key: str, kind: int) -> Any:
        what = f"the value of {show(key)}"
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            self._need(dtype.itemsize, what)
            value = np.frombuffer(self._mm, dtype, 1, self._off)[0].item()
            self._off += dtype.itemsize
            return value
        if kind == STRING:
            return self._str(what)
        if kind != ARRAY:
            raise ModelError(f"{self.path}: metadata key {show(key)} has value type {kind}, not one GGUF defines")
        item, count = self._u32(what), self._u64(what)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            self._need(count * dtype.itemsize, what)
            values = np.frombuffer(self._mm, dtype, count, self._off)
            self._off += count * dtype.itemsize
            return values
        if item != STRING:
            raise ModelError(f"{self.path}: metadata key {show(key)} is an array of type {item}, which is not read")
        self._need(count * 8, what)  # every item is at least its length
        if count > MAX_STRINGS:
            raise ModelError(f"{self.path}: metadata key {show(key)} holds {count:,} strings; at most {MAX_STRINGS:,}")
        starts, lengths = array("q"), array("q")
        for _ in range(count):
            n = self._u64(what)
            self._need(n, what)
            starts.append(self._off)
            lengths.append(n)
            self._off += n
        return _Strings(starts, lengths)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def size_bytes(self) -> int:
        return self._size

    def get(self, key: str, default: Any = ...) -> Any:
        """A metadata value: a scalar, a string, a numpy array (numeric arrays) or a list of strings;
        ``default`` when absent, or a ``ModelError`` without one."""
        value = self._fields.get(key, ...)
        if value is ...:
            if default is ...:
                raise ModelError(f"{self.path}: no metadata key {key!r}")
            return default
        if isinstance(value, _Strings):
            mm = self._mm
            try:
                return [mm[s : s + n].decode("utf-8") for s, n in zip(value.starts, value.lengths)]
            except UnicodeDecodeError as exc:
                raise ModelError(f"{self.path}: metadata key {key!r} holds a string that is not UTF-8") from exc
        return value

    def has(self, key: str) -> bool:
        return key in self._fields

    def length(self, key: str) -> int | None:
        """How many items the array under ``key`` holds (None: absent or not an array), without reading them."""
        value = self._fields.get(key)
        return len(value) if isinstance(value, (_Strings, np.ndarray)) else None

    def integer(self, key: str, default: Any = ..., lo: int = 1, hi: int = 1 << 31) -> int:
        """An integer value in ``lo..hi``; anything else is a ``ModelError`` naming the key and its value."""
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ModelError(f"{self.path}: metadata {key} is {show(value)}; it must be an integer in {lo:,}..{hi:,}")
        return value

    def number(self, key: str, default: Any = ..., below: float = math.inf) -> float:
        """A finite number above 0 and below ``below``; anything else is a ``ModelError`` naming the key."""
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < below:
            bound = f"below {below:g}" if below != math.inf else "finite"
            raise ModelError(f"{self.path}: metadata {key} is {show(value)}; it must be a number above 0, {bound}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        """A boolean value (GGUF's bool, or an integer 0 or 1)."""
        value = self.get(key, default)
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise ModelError(f"{self.path}: metadata {key} is {show(value)}; it must be true or false")

    def strings(self, key: str) -> list[str]:
        """A string array (``ModelError`` when absent or of another kind)."""
        if not isinstance(self._fields.get(key), _Strings):
            raise ModelError(f"{self.path}: metadata {key} is {show(self.get(key))}; it must be an array of strings")
        return self.get(key)  # get decodes _Strings to list[str]

    def numbers(self, key: str, count: int, kinds: str = "iuf") -> np.ndarray:
        """A numeric array of ``count`` items whose numpy kind is one of ``kinds``."""
        value = self.get(key)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds:
            raise ModelError(f"{self.path}: metadata {key} is {show(value)}; it must be an array of numbers")
        if value.size != count:
            raise ModelError(f"{self.path}: metadata {key} has {value.size:,} items for {count:,} tokens")
        return value

    def tensor_infos(self) -> list[TensorInfo]:
        return [t.info for t in self._tensors.values()]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        return self._tensor(name).info

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, rows first (``[out, in]`` for a linear weight)."""
        gguf = _gguf()
        t = self._tensor(name)
        qtype = gguf.GGMLQuantizationType(t.qtype)
        shape = t.info.shape
        data = np.frombuffer(self._mm, np.uint8, t.nbytes, t.offset)
        try:
            values = gguf.quants.dequantize(data.reshape(-1, t.row_bytes) if t.row_bytes else data, qtype)
        except NotImplementedError as exc:
            raise ModelError(
                f"{self.path}: tensor {name!r} has block type {qtype.name}, which this gguf package "
                f"cannot dequantize ({_reason(exc)})"
            ) from exc
        except Exception as exc:
            raise ModelError(f"{self.path}: tensor {name!r} cannot be read ({_reason(exc)})") from exc
        values = np.asarray(values, dtype=np.float32)
        if values.size != math.prod(shape):
            raise ModelError(f"{self.path}: tensor {name!r} holds {values.size} values, its shape says {shape}")
        return values.reshape(shape)

    def _tensor(self, name: str) -> _Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: no tensor {name!r} (a GGUF of this architecture has one)")
        return t


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
