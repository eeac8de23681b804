"""Opt-in capture of a sample of real traffic as calibration manifests (``[calibration]``).

What it guarantees:

- serving never waits for it: an admitted item goes into a bounded queue that one writer thread
  empties; when the queue is full the item is dropped and counted (``dropped``), never waited for;
- a bounded sample: every 1/``rate``-th request (a credit that grows by ``rate`` per offer and spends
  1 per kept item: deterministic, no bursts), at most ``max_items`` per workload (then that workload
  stops; the first items stay), at most ``max_bytes`` in the directory (counted across restarts);
- manifests a build reads as they are (``engines/datasets.py``): ``llm.jsonl`` holds
  ``{"messages": [...]}`` or ``{"prompt": "..."}`` lines, ``asr.jsonl`` holds
  ``{"audio": "asr/N.wav", "text": "<the recogniser's final>"}`` with 16-bit mono WAV files;
- a manifest always ends at the end of a whole record: a line is appended on an ``O_APPEND``
  descriptor, a short write is continued, and a write that fails part-way (ENOSPC on a full disk) is
  truncated back to where the line began, so the next record never lands glued onto a torn one; when
  even that truncation fails, the tear is cut before the next line is added. A torn last line left by
  a power loss is cut at the next start. A WAV is renamed into place before its line is written, and
  removed again when its line cannot be;
- files are 0640 and the directory 0750: prompts and voice are personal data.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engines.datasets import CAPTURE_ASR, CAPTURE_LLM
from ..models.tokenizer import Message

log = logging.getLogger(__name__)

WORKLOADS = ("llm", "asr")
_FILE_MODE, _DIR_MODE = 0o640, 0o750


@dataclass
class CaptureCounts:
    """One workload's counters: offered to the sampler, admitted, written, and why others were not."""

    offered: int = 0
    admitted: int = 0
    written: int = 0
    dropped: int = 0  # the writer's queue was full
    over_bytes: int = 0  # max_bytes reached
    failed: int = 0  # a write failed (disk full, permissions): logged


@dataclass
class Sampler:
    """The pure admission rule: a fraction ``rate`` of offers, at most ``max_items`` in all."""

    rate: float
    max_items: int
    taken: int = 0
    credit: float = -1.0  # set in __post_init__: the first offer is kept, so a capture shows up at once

    def __post_init__(self) -> None:
        if self.credit < 0:
            self.credit = 1.0 - self.rate

    def admit(self) -> bool:
        if self.taken >= self.max_items:
            return False
        self.credit += self.rate
        if self.credit < 1.0 - 1e-9:
            return False
        self.credit -= 1.0
        self.taken += 1
        return True


class Capture:
    """The capture of one daemon: ``llm(prompt)`` and ``asr(chunks, rate, text)`` from serving threads,
    files written by its own thread (``start``/``stop``). See the module doc."""

    def __init__(
        self,
        directory: Path,
        rate: float,
        max_items: int,
        max_bytes: int,
        *,
        llm: bool = True,
        asr: bool = True,
        queue_size: int = 64,
    ) -> None:
        self.dir, self.max_bytes = Path(directory), max_bytes
        self.enabled = {"llm": llm, "asr": asr}
        self.counts = {w: CaptureCounts() for w in WORKLOADS}
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._bytes, self._next_wav = 0, 0  # set from what is on disk by _prepare
        self._torn: set[str] = set()  # manifests whose failed append could not be cut back (writer thread)
        self._prepare()
        self._samplers = {w: Sampler(rate, max_items, taken=self._lines(w)) for w in WORKLOADS}
        self._thread: threading.Thread | None = None

    # -- serving threads: never block ---------------------------------------------------------------

    def llm(self, prompt: str | Sequence[Message]) -> None:
        """A request's prompt (a string) or chat messages (objects with ``role`` and ``content``)."""
        if isinstance(prompt, str):
            record: dict[str, Any] = {"prompt": prompt}
        else:
            record = {"messages": [{"role": m.role, "content": m.content} for m in prompt]}
        self._offer("llm", record)

    def asr(self, chunks: Sequence[np.ndarray], sample_rate: int, text: str) -> None:
        """An utterance's audio (float samples in [-1, 1], in pieces) and its final text."""
        if text.strip():  # an empty final is noise the endpointer cut: nothing to calibrate on
            self._offer("asr", (list(chunks), sample_rate, text))

    def _offer(self, workload: str, item: Any) -> None:
        if not self.enabled[workload]:
            return
        with self._lock:
            counts = self.counts[workload]
            counts.offered += 1
            if not self._samplers[workload].admit():
                return
            counts.admitted += 1
        try:
            self._queue.put_nowait((workload, item))
        except queue.Full:
            with self._lock:
                counts.dropped += 1

    # -- the writer thread ----------------------------------------------------------------------------

    def start(self) -> Capture:
        self._thread = threading.Thread(target=self._run, name="calibration-capture", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (within ``timeout_s``), then end the thread."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            workload, item = entry
            try:
                self._write(workload, item)
            except OSError as exc:
                with self._lock:
                    self.counts[workload].failed += 1
                log.warning("calibration capture: cannot write to %s: %s", self.dir, exc)

    def _write(self, workload: str, item: Any) -> None:
        if workload == "llm":
            self._append(CAPTURE_LLM, item, workload)
            return
        chunks, rate, text = item
        pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        data = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        if not self._room(len(data) + 44, workload):
            return
        n, self._next_wav = self._next_wav, self._next_wav + 1
        rel = f"asr/{n:06d}.wav"
        tmp = self.dir / f"asr/.{n:06d}.wav.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
            with os.fdopen(fd, "wb") as fh, wave.open(fh, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(rate)
                w.writeframes(data)
            os.replace(tmp, self.dir / rel)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: give the space of the partial file back at once
            raise
        self._bytes += len(data) + 44
        try:
            self._append(CAPTURE_ASR, {"audio": rel, "text": text}, workload)
        except OSError:
            # No line names this WAV: nothing would ever read it, yet it would count against max_bytes.
            (self.dir / rel).unlink(missing_ok=True)
            self._bytes -= len(data) + 44
            raise

    def _room(self, size: int, workload: str) -> bool:
        if self._bytes + size <= self.max_bytes:
            return True
        with self._lock:
            self.counts[workload].over_bytes += 1
        return False

    def _append(self, name: str, record: dict[str, Any], workload: str) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if not self._room(len(line), workload):
            return
        path = self.dir / name
        if name in self._torn:  # an earlier tear could not be cut then: cut it before adding to it
            _cut_torn_tail(path)
            self._torn.discard(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, _FILE_MODE)
        try:
            # This thread is the only writer, so the file ends here until the line is written.
            start = os.fstat(fd).st_size
            try:
                _write_all(fd, line)
            except OSError:
                try:
                    os.ftruncate(fd, start)  # shrinking needs no free space, so a full disk allows it
                except OSError:
                    self._torn.add(name)
                raise
        finally:
            os.close(fd)
        self._bytes += len(line)
        with self._lock:
            self.counts[workload].written += 1

    # -- start: what an earlier run left -----------------------------------------------------------

    def _prepare(self) -> None:
        (self.dir / "asr").mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        for d in (self.dir, self.dir / "asr"):
            os.chmod(d, _DIR_MODE)
        for name in (CAPTURE_LLM, CAPTURE_ASR):
            if (self.dir / name).is_file():
                _cut_torn_tail(self.dir / name)  # a line torn by a power loss
        for tmp in (self.dir / "asr").glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        self._bytes = sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file())
        self._next_wav = 1 + max(
            (int(p.stem) for p in (self.dir / "asr").glob("*.wav") if p.stem.isdigit()), default=-1
        )

    def _lines(self, workload: str) -> int:
        path = self.dir / (CAPTURE_LLM if workload == "llm" else CAPTURE_ASR)
        return path.read_bytes().count(b"\n") if path.is_file() else 0


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: a short write is continued; one that writes nothing is a full disk."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def _cut_torn_tail(path: Path, block: int = 1 << 16) -> None:
    """Cut ``path`` back to just after its last newline, so it ends at a whole record (a file that already
    does is left alone). Read backwards block by block: the tail, not the whole manifest."""
    with path.open("r+b") as fh:
        end = pos = fh.seek(0, os.SEEK_END)
        keep = 0
        while pos > 0:
            step = min(block, pos)
            fh.seek(pos - step)
            newline = fh.read(step).rfind(b"\n")
            if newline >= 0:
                keep = pos - step + newline + 1
                break
            pos -= step
        if keep != end:
            fh.truncate(keep)
