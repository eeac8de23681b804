"""edge_agent/heap.py against glibc itself: with the threshold pinned, a large block freed does not move
later ones of a megabyte or two onto the heap (where they would stay resident after the burst). Run in fresh
interpreters, where glibc's threshold is at its default."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

libc_name = ctypes.util.find_library("c")
if not libc_name or not hasattr(ctypes.CDLL(libc_name), "mallinfo2"):
    pytest.skip("glibc's malloc (mallinfo2) is not this platform's", allow_module_level=True)

PROBE = """
import ctypes, ctypes.util, sys
from edge_agent.heap import pin_mmap_threshold

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in FIELDS.split()]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pinned":
    pin_mmap_threshold()
libc.free(libc.malloc(8 << 20))  # by default this raises glibc's threshold to 8 MB
before = libc.mallinfo2().hblks
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _mapped_blocks(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_a_pinned_threshold_keeps_megabyte_blocks_mapped_apart_after_a_larger_one_was_freed():
    assert _mapped_blocks("default") == 0  # glibc raised its threshold: the 2 MB block came from the heap
    assert _mapped_blocks("pinned") == 1  # its own mapping, returned to the system when freed
