"""A GGUF file opened, validated and read as float32 arrays, with errors that name the file and the fault.

GGUF (llama.cpp's format, v2/v3): a header, key/value metadata (``general.architecture``,
``<arch>.block_count``, ``tokenizer.ggml.tokens`` …), tensor infos, then aligned tensor data. The
``gguf`` package reads it (memory-mapped) and dequantizes every block type llama.cpp writes (Q4_0 …
Q8_0, the K-quants, IQ*) with numpy. Shapes come out the way llama.cpp's converters store them:
``[out, in]`` for a linear weight (PyTorch's layout), ``[vocab, hidden]`` for the embedding table.

What is refused, each as a ``ModelError`` naming the file: not a GGUF, a truncated or corrupt file
(header, metadata or tensor data past the end), a block type this ``gguf`` cannot dequantize, a
missing tensor or metadata key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, ModelError


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # a core dependency; only a broken install gets here
        raise BackendUnavailable("reading GGUF files needs the 'gguf' package: pip install gguf") from exc
    return gguf


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file: its name, numpy shape (rows first) and block type."""

    name: str
    shape: tuple[int, ...]
    block_type: str  # F32, F16, Q8_0, Q4_K, …


class GgufFile:
    """An opened GGUF: metadata values by key, tensor infos by name, ``tensor(name)`` as float32."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        gguf = _gguf()
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise ModelError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        if magic != b"GGUF":
            raise ModelError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises ValueError, IndexError, KeyError … on damaged files
            raise ModelError(f"{self.path}: a damaged or truncated GGUF file ({_reason(exc)})") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelError(
                    f"{self.path}: truncated: tensor {t.name!r} ends at byte {end:,}, the file has {size:,}"
                )
        self.version = int(self.get("GGUF.version", 0))

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def get(self, key: str, default: Any = ...) -> Any:
        """A metadata value (scalar, string or list); ``default`` when absent, or a ``ModelError`` without one."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ModelError(f"{self.path}: no metadata key {key!r}")
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ModelError(f"{self.path}: metadata key {key!r} is unreadable ({_reason(exc)})") from exc

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def tensor_infos(self) -> list[TensorInfo]:
        return [
            TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
            for t in self._reader.tensors
        ]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, rows first (``[out, in]`` for a linear weight)."""
        gguf = _gguf()
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelError(
                f"{self.path}: tensor {name!r} has block type {t.tensor_type.name}, which this gguf package "
                f"cannot dequantize ({_reason(exc)})"
            ) from exc
        except Exception as exc:
            raise ModelError(f"{self.path}: tensor {name!r} cannot be read ({_reason(exc)})") from exc
        values = np.asarray(values, dtype=np.float32)
        if values.size != int(np.prod(shape)):
            raise ModelError(f"{self.path}: tensor {name!r} holds {values.size} values, its shape says {shape}")
        return values.reshape(shape)

    def _tensor(self, name: str) -> Any:
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: no tensor {name!r} (a GGUF of this architecture has one)")
        return t


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
