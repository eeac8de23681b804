"""Fuzzing with a fixed seed: a few hundred mutated GGUF headers through ``models import``, and a few hundred
mutated Wyoming event streams through a running server (``tests/wyoming_harness.py``). Every GGUF either
imports or is refused with one ``ModelError`` line; every stream is answered or closed with at most a log
line, never a traceback; memory stays bounded throughout (traced allocations, numpy's included)."""

from __future__ import annotations

import json
import random
import socket
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.gguf_files import TinyConfig, make_weights, spm_vocab, write_gguf

pytestmark = pytest.mark.slow

SEED = 45
CASES = 300
TIME_BUDGET_S = 240  # both lanes together take well under a minute on two cores; a regression to minutes fails


def _header_end(path: Path) -> int:
    """Where the good file's tensor data begins, as the gguf package reads it: the header is what is mutated."""
    import gguf

    return min(int(t.data_offset) for t in gguf.GGUFReader(str(path)).tensors)


def _slots(path: Path) -> list[tuple[int, int]]:
    """(offset, size) of every scalar of the good file's header, as the gguf package reads it: the counts,
    lengths, value and item types, scalar values, tensor dimensions, block types and offsets."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data
    fields = [*reader.fields.values(), *(t.field for t in reader.tensors)]
    return sorted(
        {
            (part.ctypes.data - base, part.itemsize)
            for f in fields
            for part in f.parts
            if isinstance(part, np.ndarray) and part.size == 1 and part.itemsize in (4, 8)
        }
    )


def _mutate_bytes(rng: random.Random, raw: bytes, end: int, slots: list[tuple[int, int]]) -> bytes:
    data = bytearray(raw)
    kind = rng.randrange(8)
    at = rng.randrange(4, end)
    if kind == 0:  # flip a few bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(4, end)
            data[i] ^= 1 << rng.randrange(8)
    elif kind in (1, 6, 7):  # a count, length, type or value of the header set to an edge
        at, size = rng.choice(slots)
        if size == 8:
            value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1, rng.randrange(2**64)])
            data[at : at + 8] = struct.pack("<Q", value)
        else:
            value = rng.choice([0, 1, 2, 7, 8, 9, 13, 40, 255, 2**31, 2**32 - 1, rng.randrange(2**32)])
            data[at : at + 4] = struct.pack("<I", value)
    elif kind == 2:  # a u32 anywhere
        data[at : at + 4] = struct.pack("<I", rng.choice([0, 7, 8, 9, 13, 40, 255, 2**31, 2**32 - 1]))
    elif kind == 3:  # truncated
        del data[at:]
    elif kind == 4:  # bytes inserted or removed: everything after shifts
        if rng.random() < 0.5:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            del data[at : at + rng.randint(1, 16)]
    else:  # a run of garbage
        n = rng.randint(1, 64)
        data[at : at + n] = bytes(rng.randrange(256) for _ in range(n))
    return bytes(data)


def test_mutated_gguf_headers_import_or_are_refused_in_one_line(tmp_path):
    from edge_agent.errors import ModelError
    from edge_agent.importers import import_model

    cfg = TinyConfig(
        "llama", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=32, vocab=spm_vocab(), tied=True
    )
    good = write_gguf(tmp_path / "good.gguf", cfg, make_weights(cfg))
    raw, end, slots = good.read_bytes(), _header_end(good), _slots(good)
    rng = random.Random(SEED)
    outcomes = {"imported": 0, "refused": 0}
    started = time.monotonic()
    tracemalloc.start()
    try:
        for case in range(CASES):
            src = tmp_path / f"m{case}.gguf"
            src.write_bytes(_mutate_bytes(rng, raw, end, slots))
            tracemalloc.reset_peak()
            try:
                import_model(src, tmp_path / "out" / f"m{case}", tmp_path / "cache")
                outcomes["imported"] += 1
            except ModelError as exc:
                assert "\n" not in str(exc) and len(str(exc)) < 600, (case, str(exc))
                outcomes["refused"] += 1
            except Exception as exc:  # the fault this test exists for: say which case and how
                pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 96 << 20, (case, f"{peak / 2**20:.0f} MiB")
            src.unlink()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < TIME_BUDGET_S
    assert outcomes["refused"] > CASES // 2, outcomes  # the mutations do reach the checks


# -- Wyoming --------------------------------------------------------------------------------------

_VALUES = [None, -1, 0, 1.5, True, 2**70, "x" * 3000, [], {}, {"a": [[[]]]}, "16000", [16000]]


def _stream(rng: random.Random) -> bytes:
    from tests.wyoming_harness import event_bytes

    fmt = {"rate": rng.choice([16000, 8000, 44100, 48000]), "width": rng.choice([1, 2, 4]), "channels": 1}
    frame = fmt["width"]
    events = [
        ("describe", None, b""),
        ("transcribe", {"language": "en"}, b""),
        ("audio-start", dict(fmt), b""),
        *[("audio-chunk", dict(fmt), bytes(frame * rng.randint(1, 4000))) for _ in range(rng.randint(1, 4))],
        ("audio-stop", {}, b""),
        ("transcript", {"text": "hello"}, b""),
    ]
    mutation = rng.randrange(5)
    if mutation == 0:  # a field's value of another kind
        i = rng.randrange(1, len(events))
        kind, data, payload = events[i]
        data = dict(data or {"text": "x"})
        data[rng.choice([*data, "rate", "text", "language"])] = rng.choice(_VALUES)
        events[i] = (kind, data, payload)
    elif mutation == 1:  # a field dropped
        i = rng.randrange(1, len(events))
        kind, data, payload = events[i]
        if data:
            data.pop(rng.choice(list(data)))
    elif mutation == 2:  # a type of another service, or a long one
        i = rng.randrange(len(events))
        events[i] = (rng.choice(["x" * 50_000, "ping", "synthesize", "detect", ""]), *events[i][1:])
    raw = b"".join(event_bytes(k, d, p) for k, d, p in events)
    if mutation == 3:  # bytes flipped anywhere
        data = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        raw = bytes(data)
    elif mutation == 4:  # a header of another shape
        header = {"type": "audio-chunk", "data": fmt, "payload_length": rng.choice([-5, 10**9, "7", 3])}
        if rng.random() < 0.5:
            header["data"] = json.loads("[" * 500 + "]" * 500)
        raw = raw[: rng.randrange(len(raw))] + json.dumps(header).encode() + b"\n" + bytes(3)
    return raw


def _send(port: int, raw: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)  # the end of the stream: the server sees EOF, never an idle wait
        except (BrokenPipeError, ConnectionResetError):
            return
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass


def test_mutated_wyoming_streams_are_answered_or_closed_without_a_traceback():
    from tests.wyoming_harness import LINE_MAX, Harness, still_serves

    rng = random.Random(SEED)
    h = Harness(idle_timeout_s=30.0)
    started = time.monotonic()
    tracemalloc.start()
    try:
        for _ in range(CASES):
            _send(h.port, _stream(rng))
        peak = tracemalloc.get_traced_memory()[1]
        still_serves(h.port)
    finally:
        tracemalloc.stop()
        h.stop()
    lines = h.lines()
    assert not [line for line in lines if "Traceback" in line or "internal error" in line], lines[:20]
    assert not [r for r in h.records if r.levelname in ("ERROR", "CRITICAL")]
    assert max(len(line) for line in lines) < LINE_MAX
    assert sum("closed:" in line for line in lines) > CASES // 4  # the mutations do reach the checks
    assert peak < 128 << 20, f"{peak / 2**20:.0f} MiB"
    assert time.monotonic() - started < TIME_BUDGET_S
