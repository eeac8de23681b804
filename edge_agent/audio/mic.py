"""Microphone capture through ``sounddevice`` (PortAudio), with resampling and reconnection.

- device: a name (exact, else a unique case-insensitive substring of an input device's name), an
  index, or None for the system default input;
- 16 kHz mono float32 when the device takes it, else the device's own rate resampled here;
- overflows (PortAudio dropped input because the reader was late) and blocks dropped because the
  consumer was late are counted and reported;
- a device that stops delivering (unplugged USB microphone, a PulseAudio restart) is closed and
  reopened with exponential backoff; PortAudio's device list is refreshed before each try;
- no input device at all: ``NoAudioDevice``, saying what was found and what to do.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import InputError
from . import TARGET_RATE
from .resample import Resampler

log = logging.getLogger(__name__)


class NoAudioDevice(InputError):
    """No usable audio input device."""


def _sounddevice():
    if importlib.util.find_spec("sounddevice") is None:
        raise InputError(
            "microphone capture needs sounddevice: pip install 'edge-agent[audio]' (and apt install libportaudio2)"
        )
    try:
        import sounddevice
    except OSError as exc:  # the module is there, the PortAudio library is not
        raise InputError(f"sounddevice cannot load PortAudio ({exc}): apt install libportaudio2") from exc
    return sounddevice


def input_devices(sd=None) -> list[dict]:
    sd = sd or _sounddevice()
    return [dict(d, index=i) for i, d in enumerate(sd.query_devices()) if d.get("max_input_channels", 0) > 0]


def resolve_device(device: str | int | None, sd=None) -> dict:
    """The input device dict for a name, index or None (the default input)."""
    sd = sd or _sounddevice()
    devices = input_devices(sd)
    names = ", ".join(f"[{d['index']}] {d['name']}" for d in devices) or "none"
    if not devices:
        raise NoAudioDevice(
            "no audio input device found: connect a microphone (or start PulseAudio); "
            "`edge-agent doctor` lists what the system sees"
        )
    if device is None:
        try:
            info = sd.query_devices(kind="input")
        except Exception as exc:
            raise NoAudioDevice(f"no default audio input ({exc}); set audio.device to one of: {names}") from exc
        return next((d for d in devices if d["name"] == info["name"]), dict(info, index=info.get("index", 0)))
    if isinstance(device, int) or (isinstance(device, str) and device.isdigit()):
        index = int(device)
        for d in devices:
            if d["index"] == index:
                return d
        raise NoAudioDevice(f"audio input device {index} does not exist or has no inputs; inputs: {names}")
    exact = [d for d in devices if d["name"] == device]
    if exact:
        return exact[0]
    matches = [d for d in devices if device.lower() in d["name"].lower()]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NoAudioDevice(f"no audio input device matches {device!r}; inputs: {names}")
    raise InputError(
        f"{device!r} matches several input devices ({', '.join(d['name'] for d in matches)}); "
        "give a longer name or the index"
    )


@dataclass
class MicStats:
    """What a capture lost and where it ran: overflows, dropped blocks, reconnects, the device's rate and name."""

    overflows: int = 0  # PortAudio input overflows (samples lost before we saw them)
    dropped_blocks: int = 0  # blocks dropped because the consumer fell behind
    reconnects: int = 0
    device_rate: int = 0
    device_name: str = ""


class MicSource:
    """Blocks from a live input device at 16 kHz mono."""

    _instances: ClassVar[weakref.WeakSet[MicSource]] = weakref.WeakSet()  # every open capture in this process

    def __init__(
        self,
        device: str | int | None = None,
        block_ms: int = 20,
        *,
        capture_rate: int | None = None,
        stall_s: float = 2.0,
        start_timeout_s: float = 6.0,
        backoff_s: tuple[float, float] = (0.5, 8.0),
        max_queue_blocks: int = 500,
        sd=None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sd = sd or _sounddevice()
        self.device, self.block_ms, self.rate = device, block_ms, TARGET_RATE
        self.stall_s, self.backoff_s, self.start_timeout_s = stall_s, backoff_s, start_timeout_s
        self.capture_rate = capture_rate  # None: 16 kHz if the device takes it, else its default rate
        self.stats = MicStats()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_blocks)
        self._stream = None
        self._resampler: Resampler | None = None
        self._closed = threading.Event()
        self._clock = clock
        self._opened_at = clock()
        self._open()  # fail now, with a clear message, if there is no device
        MicSource._instances.add(self)

    def _open(self) -> None:
        sd = self._sd
        info = resolve_device(self.device, sd)
        rate = self.capture_rate or TARGET_RATE
        try:
            sd.check_input_settings(device=info["index"], samplerate=rate, channels=1, dtype="float32")
        except Exception:
            rate = int(info.get("default_samplerate") or 48000)
            log.info(
                "input %r does not take %d Hz; capturing at %d Hz and resampling",
                info["name"],
                self.capture_rate or TARGET_RATE,
                rate,
            )
        self._resampler = Resampler(rate, TARGET_RATE)
        blocksize = max(1, rate * self.block_ms // 1000)
        try:
            stream = sd.InputStream(
                device=info["index"],
                samplerate=rate,
                channels=1,
                dtype="float32",
                blocksize=blocksize,
                callback=self._callback,
            )
            stream.start()
        except Exception as exc:
            raise NoAudioDevice(f"cannot open audio input {info['name']!r} at {rate} Hz: {exc}") from exc
        self._stream = stream
        self._opened_at = self._clock()
        self.stats.device_rate, self.stats.device_name = rate, str(info["name"])
        log.info("capturing from %r at %d Hz", info["name"], rate)

    def _callback(self, indata, frames, time_info, status) -> None:  # PortAudio's thread: no blocking
        if status and status.input_overflow:
            self.stats.overflows += 1
        try:
            self._queue.put_nowait(np.array(indata[:, 0], dtype=np.float32))
        except queue.Full:
            self.stats.dropped_blocks += 1

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.abort()
                stream.close()
            except Exception as exc:  # a vanished device can fail to close; it is gone either way
                log.debug("closing the input stream: %s", exc)

    def _reconnect(self) -> bool:
        self._close_stream()
        delay = self.backoff_s[0]
        while not self._closed.is_set():
            self.stats.reconnects += 1
            try:
                # PortAudio enumerates devices once; re-initialise it to see a re-plugged one, but
                # only when no other capture is running (Pa_Terminate would close its stream too).
                if not any(m is not self and m._stream is not None for m in list(MicSource._instances)):
                    self._sd._terminate()
                    self._sd._initialize()
                self._open()
                log.warning("audio input reconnected (%s)", self.stats.device_name)
                return True
            except Exception as exc:
                log.warning("audio input unavailable (%s); retrying in %.1f s", exc, delay)
                if self._closed.wait(delay):
                    break
                delay = min(delay * 2, self.backoff_s[1])
        return False

    def blocks(self) -> Iterator[np.ndarray]:
        last = self._opened_at
        delivering = False  # a fresh stream may take seconds to its first callback (PulseAudio: up to ~2 s)
        while not self._closed.is_set():
            try:
                block = self._queue.get(timeout=0.1)
            except queue.Empty:
                stream = self._stream
                silent_s = self._clock() - last
                stalled = silent_s > (self.stall_s if delivering else max(self.stall_s, self.start_timeout_s))
                if stream is None or not stream.active or stalled:
                    log.warning("audio input %r stopped delivering; reconnecting", self.stats.device_name)
                    if not self._reconnect():
                        return
                    last, delivering = self._opened_at, False
                continue
            last, delivering = self._clock(), True
            out = self._resampler.push(block) if self._resampler else block
            if out.size:
                yield out

    def close(self) -> None:
        self._closed.set()
        self._close_stream()
