"""Real microphone capture: sounddevice's InputStream on a PulseAudio null sink fed by ``paplay``.

The test starts its own PulseAudio server (a child process with a private runtime dir), makes the
null sink's monitor the default source, and plays espeak-ng speech into the sink: PortAudio's real
callback then delivers it at 16 kHz in 20 ms blocks, as a USB microphone would. Skipped, with the
reason, when PulseAudio or PortAudio is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.audio.mic import MicSource, NoAudioDevice, resolve_device
from edge_agent.errors import InputError
from tests.speech import speech_wav

# A real PulseAudio server and real-time capture: seconds per test (scripts/test --all).
pytestmark = pytest.mark.slow


class PulseServer:
    def __init__(self, runtime: Path) -> None:
        self.runtime = runtime
        self.env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(runtime),
            "PULSE_RUNTIME_PATH": str(runtime / "pulse"),
            "HOME": str(runtime),
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "pulseaudio",
                "--daemonize=no",
                "--exit-idle-time=-1",
                "-n",
                "--disallow-exit",
                "--load=module-native-protocol-unix",
                "--load=module-null-sink sink_name=edge rate=16000 channels=1",
                "--load=module-always-sink",
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pulseaudio exited with {self.proc.returncode}")
            if self.pactl("info").returncode == 0:
                self.pactl("set-default-source", "edge.monitor")
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("pulseaudio did not answer within 15 s")

    def pactl(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(["pactl", *args], env=self.env, capture_output=True, timeout=10)

    def play(self, wav: Path) -> subprocess.Popen:
        return subprocess.Popen(
            ["paplay", "--device=edge", str(wav)], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def pulse(tmp_path, monkeypatch):
    for tool in ("pulseaudio", "pactl", "paplay"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apt install pulseaudio pulseaudio-utils)")
    try:
        import sounddevice as sd
    except (ImportError, OSError) as exc:
        pytest.skip(f"sounddevice/PortAudio unavailable: {exc}")
    runtime = tmp_path / "pulse-runtime"
    runtime.mkdir(mode=0o700)
    server = PulseServer(runtime)
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"PulseAudio could not start here: {exc}")
    for key in ("XDG_RUNTIME_DIR", "PULSE_RUNTIME_PATH", "HOME"):
        monkeypatch.setenv(key, server.env[key])
    sd._terminate()
    sd._initialize()
    if not any(d["name"] == "pulse" for d in sd.query_devices() if d["max_input_channels"] > 0):
        server.stop()
        pytest.skip("PortAudio has no 'pulse' ALSA device (apt install libasound2-plugins)")
    yield server
    server.stop()


def capture(mic: MicSource, seconds: float) -> list[np.ndarray]:
    blocks, end = [], time.monotonic() + seconds
    for block in mic.blocks():
        blocks.append(block)
        if time.monotonic() >= end:
            break
    return blocks


@pytest.mark.parametrize("capture_rate", [None, 48000], ids=["16k", "48k-resampled"])
def test_real_input_stream_delivers_speech_to_the_asr_service(pulse, capture_rate, tmp_path):
    from edge_agent.models.asr import open_recognizer
    from edge_agent.models.catalog import resolve_model
    from edge_agent.serving.asr.batcher import BatchLimits
    from edge_agent.serving.asr.service import AsrService

    engine = open_recognizer(resolve_model("demo-ctc", tmp_path), "onnxruntime")
    wav = speech_wav("turn on the kitchen lights")
    mic = MicSource("pulse", 20, capture_rate=capture_rate)
    assert mic.stats.device_rate == (capture_rate or 16000)
    finals = []
    try:
        with AsrService(engine, limits=BatchLimits(max_batch=1, batch_timeout_ms=0)) as svc:
            stream = svc.open_stream(on_event=lambda e: e.kind == "final" and finals.append(e))
            player = pulse.play(wav)
            deadline = time.monotonic() + 20
            sizes = []
            for block in mic.blocks():
                sizes.append(block.size)
                stream.feed(block)
                if finals or time.monotonic() > deadline:
                    break
            player.wait(10)
            stream.close()
            stream.wait(10)
    finally:
        mic.close()
        engine.close()
    assert finals, "no final transcript from live capture within 20 s"
    f = finals[0]
    assert f.text and f.metrics.reason == "silence"
    assert 1.0 < f.metrics.audio_s < 4.0
    # paced by the device: first_partial_ms is a real-time figure, not a file-replay artefact
    assert f.metrics.first_partial_ms is not None and f.metrics.first_partial_ms > 0
    if capture_rate is None:
        assert sizes.count(320) >= len(sizes) * 0.9  # steady 20 ms blocks at 16 kHz
    assert mic.stats.overflows >= 0 and mic.stats.dropped_blocks == 0


def test_server_restart_is_survived_by_reconnecting(pulse):
    mic = MicSource("pulse", 20, stall_s=1.0, backoff_s=(0.2, 1.0))
    try:
        assert capture(mic, 0.5)
        pulse.stop()
        restarted = threading.Timer(1.5, pulse.start)
        restarted.start()
        got, end = 0, time.monotonic() + 20
        for block in mic.blocks():
            if mic.stats.reconnects:
                got += block.size
            if got >= 16000 or time.monotonic() > end:
                break
        restarted.join(20)
    finally:
        mic.close()
    assert mic.stats.reconnects >= 1 and got >= 16000, mic.stats


def test_unknown_device_names_the_inputs_there_are(pulse):
    with pytest.raises(NoAudioDevice, match=r"no audio input device matches 'USB Mic'.*pulse"):
        MicSource("USB Mic")
    with pytest.raises(NoAudioDevice, match="does not exist"):
        MicSource(999)


class NoDevices:
    """sounddevice with nothing plugged in (query_devices() is empty)."""

    def query_devices(self, kind=None):
        if kind:
            raise RuntimeError("Error querying device -1")
        return []


def test_no_input_device_at_all_is_a_clear_error():
    with pytest.raises(NoAudioDevice, match="no audio input device found"):
        resolve_device(None, NoDevices())
    assert issubclass(NoAudioDevice, InputError)


def test_listen_two_microphones_share_one_engine(pulse, capsys):
    """Two capture devices (PulseAudio's 'pulse' and 'default' both record the sink's monitor): one
    stream each on one engine, the same speech recognised on both."""
    import json

    from edge_agent.cli import main

    wav = speech_wav("what is the weather tomorrow")
    # A fresh PulseAudio capture takes up to ~2 s to its first callback: play once both surely run.
    player = threading.Timer(4.0, lambda: pulse.play(wav))
    player.start()
    code = main(["listen", "--mic", "pulse", "--mic", "default", "--model", "demo-ctc", "--duration", "9", "--json"])
    player.join()
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    utts = report["utterances"]
    assert sorted({u["stream"] for u in utts}) == [0, 1] and all(u["text"] for u in utts), utts
    assert [s["device"] for s in report["sources"]] == ["pulse", "default"]
    assert all(s["overflows"] >= 0 and s["device_rate"] == 16000 for s in report["sources"])
    assert report["summary"]["final_ms"]["count"] == len(utts) >= 2


class FakeSoundDevice:
    """A tiny PortAudio stand-in: one 44.1 kHz-only input whose stream calls back from a thread with a
    440 Hz tone, and can be 'unplugged' (the callbacks stop, ``active`` turns False)."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.unplugged = threading.Event()

    def query_devices(self, kind=None):
        info = {"name": "Fake USB Mic", "max_input_channels": 1, "default_samplerate": 44100.0}
        return info if kind else [info]

    def check_input_settings(self, device=None, samplerate=None, channels=None, dtype=None):
        if samplerate != 44100:
            raise ValueError("Invalid sample rate")

    def _terminate(self):
        pass

    def _initialize(self):
        self.unplugged.clear()

    def InputStream(self, device, samplerate, channels, dtype, blocksize, callback):
        self.opened.append(samplerate)
        fake = self

        class Stream:
            active = False

            def start(self):
                self.active = True
                self._t = threading.Thread(target=self._run, daemon=True)
                self._t.start()

            def _run(self):
                n = 0
                while self.active and not fake.unplugged.is_set():
                    t = (n + np.arange(blocksize)) / samplerate
                    callback((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[:, None], blocksize, None, None)
                    n += blocksize
                    time.sleep(blocksize / samplerate)
                self.active = False

            def abort(self):
                self.active = False

            def close(self):
                pass

        return Stream()


def test_device_without_16k_is_captured_at_its_rate_and_resampled_and_reconnects():
    sd = FakeSoundDevice()
    mic = MicSource("fake usb", 20, sd=sd, stall_s=0.3, backoff_s=(0.05, 0.2))
    try:
        assert sd.opened == [44100] and mic.stats.device_rate == 44100
        first = capture(mic, 0.5)
        x = np.concatenate(first)
        spectrum = np.abs(np.fft.rfft(x))
        assert abs(np.argmax(spectrum) * 16000 / x.size - 440) <= 4  # still 440 Hz after 44.1 → 16 kHz
        sd.unplugged.set()
        after = capture(mic, 2.0)
    finally:
        mic.close()
    assert mic.stats.reconnects >= 1 and len(sd.opened) >= 2 and sum(b.size for b in after) > 8000
