"""[calibration] capture: the sampler, drops under a slow writer, and the manifests a build reads back."""

from __future__ import annotations

import stat
import wave
from pathlib import Path

import numpy as np
import pytest

from edge_agent.config import CalibrationConfig
from edge_agent.engines.datasets import capture_manifest, read_audio_manifest, read_text_manifest
from edge_agent.errors import InputError
from edge_agent.models.tokenizer import Message
from edge_agent.serving.capture import Capture, Sampler


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.25, 0.05, 0.3])
def test_sampler_keeps_the_fraction_spread_evenly(rate):
    s = Sampler(rate, max_items=10_000)
    kept = [i for i in range(1000) if s.admit()]
    assert kept[0] == 0  # the first offer shows the capture works at once
    assert abs(len(kept) - 1000 * rate) <= 1
    gaps = np.diff(kept)
    assert gaps.max() - gaps.min() <= 1  # no bursts: every 1/rate-th offer


def test_sampler_stops_at_max_items_and_counts_what_an_earlier_run_kept():
    s = Sampler(1.0, max_items=5, taken=3)
    assert [s.admit() for _ in range(4)] == [True, True, False, False]


def _speech(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).uniform(-0.9, 0.9, n)).astype(np.float32)


def test_captured_manifests_read_back_as_calibration_data(tmp_path):
    cap = Capture(tmp_path / "cap", 1.0, 100, 10**8).start()
    cap.llm([Message("system", "be brief"), Message("user", "what is the weather in Zürich?")])
    cap.llm("Once upon a time")
    pcm = _speech(16000, 1)
    cap.asr([pcm[:7000], pcm[7000:]], 16000, "turn on the lights")
    cap.asr([_speech(800, 2)], 16000, "  ")  # an empty final: nothing to calibrate on
    cap.stop()
    texts = read_text_manifest(capture_manifest(tmp_path / "cap", "llm"))
    assert texts[0].messages == (("system", "be brief"), ("user", "what is the weather in Zürich?"))
    assert texts[1].prompt == "Once upon a time"
    audio = read_audio_manifest(capture_manifest(tmp_path / "cap", "asr"), need_text=True)
    assert [a.text for a in audio] == ["turn on the lights"]
    with wave.open(str(audio[0].audio)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        got = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert np.abs(got / 32767 - pcm).max() < 1 / 16000  # 16-bit PCM of the same samples
    for f in (tmp_path / "cap").rglob("*"):
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) & 0o027 == 0, f  # nobody but the service user and group
    assert cap.counts["asr"].written == 1 and cap.counts["llm"].written == 2


def test_a_slow_writer_drops_instead_of_blocking(tmp_path):
    cap = Capture(tmp_path, 1.0, 100, 10**8, queue_size=2)  # the writer not started: as slow as it gets
    for i in range(5):
        cap.llm(f"prompt {i}")  # returns at once although nothing is written
    assert (cap.counts["llm"].admitted, cap.counts["llm"].dropped) == (5, 3)
    cap.start().stop()
    assert [t.prompt for t in read_text_manifest(tmp_path / "llm.jsonl")] == ["prompt 0", "prompt 1"]


def test_a_restart_continues_the_count_and_cuts_a_torn_line(tmp_path):
    cap = Capture(tmp_path, 1.0, 3, 10**8).start()
    cap.llm("a")
    cap.llm("b")
    cap.stop()
    with (tmp_path / "llm.jsonl").open("ab") as fh:
        fh.write(b'{"prompt": "tor')  # power lost mid-write
    cap = Capture(tmp_path, 1.0, 3, 10**8).start()
    for p in ("c", "d", "e"):
        cap.llm(p)
    cap.stop()
    assert [t.prompt for t in read_text_manifest(tmp_path / "llm.jsonl")] == ["a", "b", "c"]


def test_max_bytes_bounds_the_directory(tmp_path):
    cap = Capture(tmp_path, 1.0, 1000, 2000).start()
    for i in range(100):
        cap.llm(f"prompt number {i:03d} " + "x" * 40)
    cap.stop()
    total = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert 1900 < total <= 2000
    c = cap.counts["llm"]
    assert c.over_bytes > 0 and c.written + c.over_bytes + c.dropped == 100


def test_a_directory_without_the_workloads_manifest_is_refused_with_its_name(tmp_path):
    (tmp_path / "llm.jsonl").write_text('{"prompt": "x"}\n')
    assert capture_manifest(tmp_path, "llm") == tmp_path / "llm.jsonl"
    assert capture_manifest(tmp_path / "llm.jsonl", "asr") == tmp_path / "llm.jsonl"  # a file stays itself
    with pytest.raises(InputError, match=r"asr\.jsonl"):
        capture_manifest(tmp_path, "asr")
    with pytest.raises(InputError, match="calibration data not found"):
        capture_manifest(tmp_path / "nowhere", "llm")


def test_off_by_default_and_said_so():
    assert CalibrationConfig().summary() == "off"
    on = CalibrationConfig(capture_dir=Path("/tmp/x"), capture_rate=0.1, capture_asr=False)
    assert on.summary().startswith("on: llm into /tmp/x, rate 0.1")


def test_an_unusable_capture_directory_leaves_serving_running(tmp_path, caplog):
    from types import SimpleNamespace

    from edge_agent.config import Settings
    from edge_agent.daemon.app import Agent

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = Settings(calibration=CalibrationConfig(capture_dir=blocker / "capture"))
    agent = SimpleNamespace(settings=settings, llm=None, asr=None)
    assert Agent._start_capture(agent) is None  # type: ignore[arg-type]
    assert "calibration capture is off: cannot use" in caplog.text
