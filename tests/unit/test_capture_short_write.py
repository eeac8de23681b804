"""The calibration capture on a full disk: a write the disk cuts short (a short ``os.write``, or ENOSPC
part-way) never leaves part of a line behind for the next record to be glued onto; and the manifest
reader a build calls skips a line it cannot parse, names it, counts it, and keeps the others.

The disk is faked at ``os.write`` (and ``os.ftruncate``); the writer thread is joined by ``stop()``
before anything is read, so nothing here waits on time."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edge_agent.engines.datasets import CAPTURE_LLM, manifest_digest, read_text_manifest
from edge_agent.engines.stages import calibration_path
from edge_agent.errors import InputError
from edge_agent.serving import capture as capture_module
from edge_agent.serving.capture import Capture

REAL_WRITE = os.write


class FullDisk:
    """``os.write`` for the capture's manifest: the ``fail_on``-th record written gets ``keep`` bytes onto
    the disk, then either a short count back (``then="short"``) or, on the next call, ENOSPC."""

    def __init__(self, fail_on: int, keep: int, then: str) -> None:
        self.fail_on, self.keep, self.then = fail_on, keep, then
        self.records, self.failing = 0, False

    def __call__(self, fd: int, data: bytes) -> int:
        if self.failing:  # the call after a short one: the disk is still full
            self.failing = False
            raise OSError(errno.ENOSPC, "No space left on device")
        self.records += 1
        if self.records != self.fail_on:
            return REAL_WRITE(fd, data)
        written = REAL_WRITE(fd, bytes(data)[: self.keep])
        if self.then == "enospc":
            self.failing = True
        return written


def _record(i: int) -> str:
    return f"prompt number {i}: " + "ü" * 40  # multi-byte text: a cut can land inside a character


def _lines(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.decode("utf-8").splitlines()]


def _capture_through(path: Path, fake: FullDisk, monkeypatch: pytest.MonkeyPatch) -> Capture:
    cap = Capture(path, 1.0, 100, 10**8, asr=False).start()
    cap.llm(_record(0))
    cap.stop()  # the writer thread has written and ended: the disk fills only now
    monkeypatch.setattr(capture_module.os, "write", fake)
    cap.start()
    cap.llm(_record(1))
    cap.stop()
    monkeypatch.setattr(capture_module.os, "write", REAL_WRITE)  # space is back
    cap.start()
    cap.llm(_record(2))
    cap.stop()
    return cap


def test_enospc_mid_line_is_cut_back_and_the_next_record_starts_on_its_own_line(tmp_path, monkeypatch):
    cap = _capture_through(tmp_path / "cap", FullDisk(fail_on=1, keep=23, then="enospc"), monkeypatch)
    records = _lines(tmp_path / "cap" / CAPTURE_LLM)
    assert records == [{"prompt": _record(0)}, {"prompt": _record(2)}]  # the torn record is gone, not glued
    assert cap.counts["llm"].written == 2 and cap.counts["llm"].failed == 1
    assert [s.prompt for s in read_text_manifest(tmp_path / "cap" / CAPTURE_LLM)] == [_record(0), _record(2)]


def test_a_short_write_is_completed_so_the_record_is_appended_whole(tmp_path, monkeypatch):
    cap = _capture_through(tmp_path / "cap", FullDisk(fail_on=1, keep=23, then="short"), monkeypatch)
    records = _lines(tmp_path / "cap" / CAPTURE_LLM)
    assert records == [{"prompt": _record(i)} for i in range(3)]
    assert cap.counts["llm"].written == 3 and cap.counts["llm"].failed == 0


def test_a_tear_that_cannot_be_cut_at_once_is_cut_before_the_next_record(tmp_path, monkeypatch):
    def refuse(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(capture_module.os, "ftruncate", refuse)
    cap = Capture(tmp_path / "cap", 1.0, 100, 10**8, asr=False).start()
    cap.llm(_record(0))
    cap.stop()
    monkeypatch.setattr(capture_module.os, "write", FullDisk(fail_on=1, keep=23, then="enospc"))
    cap.start()
    cap.llm(_record(1))
    cap.stop()
    monkeypatch.undo()  # space is back, truncation works again
    cap.start()
    cap.llm(_record(2))
    cap.stop()
    assert _lines(tmp_path / "cap" / CAPTURE_LLM) == [{"prompt": _record(0)}, {"prompt": _record(2)}]


def test_the_byte_budget_counts_only_what_stays_on_disk(tmp_path, monkeypatch):
    cap = _capture_through(tmp_path / "cap", FullDisk(fail_on=1, keep=23, then="enospc"), monkeypatch)
    cap.stop()
    again = Capture(tmp_path / "cap", 1.0, 100, 10**8, asr=False)  # what a restart counts from the disk
    assert cap._bytes == again._bytes


# -- the reader a build calls ----------------------------------------------------------------------

GLUED = '{"prompt": "torn half of a rec{"prompt": "the record after it"}'  # what the incident left on line 2


def _folder(tmp_path: Path, lines: list[str]) -> Path:
    folder = tmp_path / "capture"
    folder.mkdir()
    (folder / CAPTURE_LLM).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


def test_a_bad_line_in_the_middle_is_skipped_named_and_counted(tmp_path, caplog):
    good = [json.dumps({"prompt": f"p{i}"}) for i in range(4)]
    folder = _folder(tmp_path, [good[0], GLUED, good[1], "[1, 2]", good[2], good[3]])
    with caplog.at_level(logging.WARNING, logger="edge_agent.engines.datasets"):
        samples = read_text_manifest(folder / CAPTURE_LLM)
    assert [s.prompt for s in samples] == ["p0", "p1", "p2", "p3"]
    assert [s.line for s in samples] == [1, 3, 5, 6]
    assert samples.skipped == 2
    text = caplog.text
    assert (
        f"{folder / CAPTURE_LLM}:2: not valid JSON" in text
        and f"{folder / CAPTURE_LLM}:4: expected a JSON object" in text
    )
    assert "2 of 6 lines skipped" in text


def test_calibrate_data_on_a_capture_folder_with_a_glued_line_calibrates_on_the_rest(tmp_path):
    # What `edge-agent calibrate --data DIR` / `build --data DIR` read: the folder's manifest for the
    # recipe's workload (calibration_path), its digest for the cache key, then its samples.
    good = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) for i in range(20)]
    folder = _folder(tmp_path, [*good[:14], GLUED, *good[14:]])
    path = calibration_path(SimpleNamespace(workload="llm"), SimpleNamespace(data=str(folder)))
    assert path == folder / CAPTURE_LLM
    assert len(manifest_digest(path, 64)) == 64
    samples = read_text_manifest(path, 64)
    assert len(samples) == 20 and samples.skipped == 1
    assert [s.messages for s in samples] == [(("user", f"question {i}"),) for i in range(20)]


def test_a_limit_counts_good_records_and_bad_lines_before_it(tmp_path):
    good = [json.dumps({"prompt": f"p{i}"}) for i in range(4)]
    folder = _folder(tmp_path, [good[0], "{torn", good[1], good[2], "{torn", good[3]])
    samples = read_text_manifest(folder / CAPTURE_LLM, limit=2)
    assert [s.prompt for s in samples] == ["p0", "p1"]


def test_a_manifest_with_no_valid_line_is_still_refused_with_the_first_bad_one_named(tmp_path):
    folder = _folder(tmp_path, ["{torn", GLUED])
    with pytest.raises(InputError, match=r"llm\.jsonl:1: not valid JSON .*none of its 2 lines is a JSON object"):
        read_text_manifest(folder / CAPTURE_LLM)


def test_a_line_cut_inside_a_character_is_one_bad_line_not_an_unreadable_file(tmp_path):
    folder = tmp_path / "capture"
    folder.mkdir()
    torn = '{"prompt": "Zü'.encode()[:-1]  # cut between the two bytes of ü
    (folder / CAPTURE_LLM).write_bytes(b'{"prompt": "a"}\n' + torn + b'{"prompt": "b"}\n')
    samples = read_text_manifest(folder / CAPTURE_LLM)
    assert [s.prompt for s in samples] == ["a"] and samples.skipped == 1


def test_an_utterance_whose_line_cannot_be_written_leaves_no_wav_behind(tmp_path, monkeypatch):
    cap = Capture(tmp_path / "cap", 1.0, 100, 10**8, llm=False).start()
    monkeypatch.setattr(capture_module.os, "write", FullDisk(fail_on=1, keep=5, then="enospc"))
    cap.asr([np.zeros(1600, np.float32)], 16000, "lights on")
    cap.stop()
    assert list((tmp_path / "cap" / "asr").iterdir()) == []  # no WAV that no line names
    assert (tmp_path / "cap" / "asr.jsonl").read_bytes() == b""
    assert cap.counts["asr"].failed == 1 and cap._bytes == 0
