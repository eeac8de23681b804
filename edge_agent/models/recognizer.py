"""What every speech recogniser offers: a shared engine, per-stream state, a batched step.

    engine = open_recognizer(ref, backend, options)      # models/asr.py; one per model, owns the session(s)
    s = engine.new_stream()                               # one per audio stream, owns its state
    s.add_audio(samples); ...; s.end()                    # any thread
    results = engine.step([s, t, ...])                    # the device thread, batched

``step`` consumes whatever audio each stream has gathered and returns, per stream, a
``Hypothesis`` (the partial so far, or the final once the stream was ended) or None when there is
nothing new to say. ``transcribe`` is the one-pass, non-streaming decode of a whole utterance.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import ModelError


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A recogniser's text for one utterance so far: partial or final, with its settled prefix."""

    text: str
    token_ids: tuple[int, ...]
    final: bool
    stable_text: str = ""  # the part that will not change any more (the committed prefix)
    audio_s: float = 0.0  # utterance audio the hypothesis covers


class AudioStream:
    """The audio a stream has gathered and not yet handed to the engine. Thread-safe."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._pending: list[np.ndarray] = []
        self._ended = False
        self.finished = False  # the final hypothesis was produced
        self.samples_in = 0

    def add_audio(self, samples: np.ndarray) -> None:
        x = np.asarray(samples, np.float32).reshape(-1)
        with self._lock:
            if self._ended:
                raise RuntimeError("audio after end(): open a new stream for the next utterance")
            if x.size:
                self._pending.append(x)
                self.samples_in += x.size

    def end(self) -> None:
        with self._lock:
            self._ended = True

    @property
    def ended(self) -> bool:
        return self._ended

    def take(self) -> tuple[np.ndarray, bool]:
        """(new samples, whether the stream has ended) and clear the pending audio."""
        with self._lock:
            pending, self._pending = self._pending, []
            ended = self._ended
        x = np.concatenate(pending) if pending else np.zeros(0, np.float32)
        return x, ended


class Recognizer(Protocol):
    """What every recogniser offers: new streams, and one batched step over many of them."""

    name: str
    kind: str
    sample_rate: int
    max_utterance_s: float

    def new_stream(self) -> AudioStream: ...

    def step(self, streams: Sequence[AudioStream]) -> list[Hypothesis | None]: ...

    def transcribe(self, samples: np.ndarray) -> Hypothesis: ...

    def close(self) -> None: ...

    # A recogniser whose steps can be stopped midway without losing anything (each step decodes its streams
    # from their audio: Whisper) has ``interruptible`` true and ``interrupt()`` (any thread: the step raises
    # ``errors.Interrupted``) and ``resume()``; the ASR service then lets a pause's decode preempt partials.


def read_json(path: Path) -> dict:
    import json

    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc
