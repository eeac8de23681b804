"""Handing freed C heap back to the system.

glibc keeps memory a program freed in its heap, so a burst (parsing a 33 MB ``tokenizer.json``, a large
request body) stays resident long after: ``release_freed_heap`` runs ``malloc_trim(0)``, which returns every
free page, and ``pin_mmap_threshold`` keeps large blocks out of the heap in the first place. Elsewhere
(musl, macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_libc: Any = None


def _libc_function(name: str) -> Any:
    """The C library's function ``name``, or None (no C library found, or not glibc's function)."""
    global _libc
    if _libc is None:
        found = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(found) if found else False
        except OSError:
            _libc = False
    return getattr(_libc, name, None) if _libc else None


def release_freed_heap() -> None:
    """Return the pages freed on the C heap to the system (glibc's ``malloc_trim``; a no-op elsewhere)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_pinned = False


def pin_mmap_threshold(size: int = 1 << 20) -> None:
    """Serve every allocation of ``size`` bytes or more with its own mapping, returned to the system when
    freed (glibc; a no-op elsewhere). By default glibc raises that threshold each time a large block is
    freed (up to 32 MB), after which a decoder's megabyte buffers (a prefill chunk's activations, a row of
    262,144 logits) come from the heap and stay resident, fragmented, after the burst that needed them.
    Process-wide; the first call sets it."""
    global _pinned
    if _pinned:
        return
    _pinned = True
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, size)
