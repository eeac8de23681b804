"""Voice activity detection and endpointing.

A detector classifies fixed frames as voiced or not; ``Endpointer`` turns that into utterances:

    idle ──(voiced for min_speech_ms)──▶ speaking ──(unvoiced for trailing_silence_ms)──▶ idle
                                         ├──(max_utterance_s reached)─────────────────────▶ idle
                                         └──(unvoiced for early_silence_ms and complete())─▶ idle, resumable

An early end (``reason="early"``) is asked of the ``complete`` callable the caller passes (the ASR
stream answers from its latest partial): it is never later than the fixed ``trailing_silence_ms``
wait, which stays the bound. Speech that resumes within what is left of that wait starts an utterance
marked ``resumes`` whose audio is everything since the early end: the caller continues the cut one.

It emits ``SpeechStart`` (with ``pre_roll_ms`` of audio from before the onset, so the first
phoneme is not cut), ``SpeechAudio`` while speaking, and ``SpeechEnd``. Times are audio-stream
seconds (samples pushed / rate), so decisions do not depend on how fast the audio arrives.

Detectors: ``EnergyVAD`` (built in: level above an adaptive noise floor), ``WebRtcVAD`` (the
``webrtcvad`` package), ``SileroVAD`` (a Silero VAD v5 ONNX file run on ONNX Runtime).
"""

from __future__ import annotations

import importlib.util
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from ..errors import InputError, ModelError
from . import TARGET_RATE


class Detector(Protocol):
    """A voice-activity detector: fixed-size frames in, speech or not out (energy, WebRTC, Silero)."""

    frame_samples: int

    def is_speech(self, frame: np.ndarray) -> bool: ...

    def reset(self) -> None: ...


class EnergyVAD:
    """Voiced = frame level above both an absolute floor and the noise floor + a margin.

    The noise floor is the quietest frame level of the last ``adapt_s`` seconds (minimum
    statistics): speech has gaps between words, so the minimum stays at the room's level while
    someone talks, and steady background noise (a fan, hiss) becomes the floor within
    ``adapt_s`` and stops counting as speech. The window starts filled with ``initial_floor_db``,
    so speech at the very start of a stream is recognised.
    """

    def __init__(
        self,
        frame_ms: int = 20,
        rate: int = TARGET_RATE,
        threshold_db: float = -50.0,
        margin_db: float = 12.0,
        adapt_s: float = 3.0,
        initial_floor_db: float = -70.0,
    ) -> None:
        self.frame_samples = rate * frame_ms // 1000
        self.threshold_db, self.margin_db, self.initial_floor_db = threshold_db, margin_db, initial_floor_db
        self._window = max(1, int(adapt_s * 1000 / frame_ms))
        self.reset()

    def reset(self) -> None:
        self._index = 0
        self._mins: deque[tuple[int, float]] = deque([(0, self.initial_floor_db)])  # sliding minimum

    @property
    def noise_db(self) -> float:
        return self._mins[0][1]

    def level_db(self, frame: np.ndarray) -> float:
        rms = math.sqrt(float(np.mean(np.square(frame, dtype=np.float64)))) if frame.size else 0.0
        return 20 * math.log10(max(rms, 1e-6))

    def is_speech(self, frame: np.ndarray) -> bool:
        level = self.level_db(frame)
        voiced = level > self.threshold_db and level > self.noise_db + self.margin_db
        self._index += 1
        while self._mins and self._mins[-1][1] >= level:
            self._mins.pop()
        self._mins.append((self._index, level))
        while self._mins[0][0] <= self._index - self._window:
            self._mins.popleft()
        return voiced


class WebRtcVAD:
    """Google's WebRTC VAD (``pip install webrtcvad``): 10/20/30 ms frames of 16-bit PCM."""

    def __init__(self, frame_ms: int = 20, rate: int = TARGET_RATE, aggressiveness: int = 2) -> None:
        if importlib.util.find_spec("webrtcvad") is None:
            raise InputError("vad = 'webrtc' needs the webrtcvad package: pip install webrtcvad")
        if frame_ms not in (10, 20, 30):
            raise InputError(f"webrtcvad takes 10, 20 or 30 ms frames, not {frame_ms}")
        import webrtcvad

        self._vad = webrtcvad.Vad(aggressiveness)
        self.rate, self.frame_samples = rate, rate * frame_ms // 1000

    def reset(self) -> None:
        pass

    def is_speech(self, frame: np.ndarray) -> bool:
        pcm = (np.clip(frame, -1, 1) * 32767).astype("<i2").tobytes()
        return bool(self._vad.is_speech(pcm, self.rate))


class SileroVAD:
    """Silero VAD v5 ONNX (``input`` [1, 64 + 512], ``state`` [2, 1, 128], ``sr`` → ``output``, ``stateN``).

    The model is given as a file path (the agent downloads nothing). 512-sample frames at 16 kHz
    with the previous frame's last 64 samples as context, as Silero's own wrapper feeds it.
    """

    CONTEXT = 64

    def __init__(self, model_path: str | Path, threshold: float = 0.5, rate: int = TARGET_RATE) -> None:
        path = Path(model_path).expanduser()
        if not path.is_file():
            raise ModelError(f"vad = 'silero' needs vad_model = the path of silero_vad.onnx; {path} does not exist")
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        self.frame_samples, self.threshold, self.rate = 512, threshold, rate
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros(self.CONTEXT, np.float32)

    def probability(self, frame: np.ndarray) -> float:
        x = np.concatenate([self._context, frame.astype(np.float32)])[None, :]
        out, self._state = self._session.run(
            None, {"input": x, "state": self._state, "sr": np.array(self.rate, np.int64)}
        )
        self._context = x[0, -self.CONTEXT :]
        return float(np.asarray(out).reshape(-1)[0])

    def is_speech(self, frame: np.ndarray) -> bool:
        return self.probability(frame) >= self.threshold


def make_detector(
    kind: Literal["energy", "webrtc", "silero"] = "energy",
    *,
    frame_ms: int = 20,
    model: str | Path | None = None,
    threshold_db: float = -50.0,
) -> Detector:
    if kind == "energy":
        return EnergyVAD(frame_ms, threshold_db=threshold_db)
    if kind == "webrtc":
        return WebRtcVAD(frame_ms)
    if kind == "silero":
        if model is None:
            raise InputError("vad = 'silero' needs vad_model = the path of silero_vad.onnx")
        return SileroVAD(model)
    raise InputError(f"unknown vad {kind!r}; choose energy, webrtc or silero")


# -- endpointing ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpeechStart:
    """An utterance began: its onset time and the audio that confirmed it (pre-roll included)."""

    at_s: float  # stream time of the onset (first voiced frame)
    audio: np.ndarray  # pre-roll + the voiced frames that confirmed the onset
    resumes: bool = False  # speech came back within the full wait after an early end: audio = all since it


@dataclass(frozen=True, slots=True)
class SpeechAudio:
    """One more frame of the current utterance."""

    audio: np.ndarray


@dataclass(frozen=True, slots=True)
class SpeechEnd:
    """The current utterance ended, with the decision's time, the last voiced time and why."""

    at_s: float  # stream time of the decision
    speech_end_s: float  # stream time where the last voiced frame ended
    reason: Literal["silence", "max_length", "end_of_stream", "early"]


Event = SpeechStart | SpeechAudio | SpeechEnd


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """When an utterance starts and ends: minimum speech, trailing silence, pre-roll, maximum length."""

    min_speech_ms: int = 100
    trailing_silence_ms: int = 500
    pre_roll_ms: int = 200
    max_utterance_s: float = 28.0
    early_silence_ms: int | None = None  # None: no early end; else the silence after which complete() is asked


class Endpointer:
    """Frames the stream for ``detector`` and emits utterance events. ``detector=None``: all speech.

    ``complete(voiced_samples)`` (with ``config.early_silence_ms``) is asked, once per silent frame from
    ``early_silence_ms`` of silence on, whether the utterance is complete; ``voiced_samples`` is the
    utterance's audio up to its last voiced frame (pre-roll included, as the recogniser was fed), so the
    caller can tell whether what it knows covers all of the speech. True ends the utterance early.
    """

    def __init__(
        self,
        detector: Detector | None,
        config: EndpointConfig = EndpointConfig(),
        rate: int = TARGET_RATE,
        complete: Callable[[int], bool] | None = None,
    ) -> None:
        self.detector, self.config, self.rate, self.complete = detector, config, rate, complete
        self.frame = detector.frame_samples if detector else rate // 50
        frame_ms = 1000 * self.frame / rate
        # Without a detector everything is speech: the utterance starts with the first frame.
        self._min_voiced = max(1, math.ceil(config.min_speech_ms / frame_ms)) if detector else 1
        self._max_silence = max(1, math.ceil(config.trailing_silence_ms / frame_ms))
        early = config.early_silence_ms
        self._early_silence = None if early is None else min(self._max_silence, max(1, math.ceil(early / frame_ms)))
        self._utt_start = 0  # stream sample where the current utterance's audio (pre-roll included) starts
        # after an early end: the stream sample where the full wait would have ended (speech that starts
        # before it continues the utterance), and the audio since the early end
        self._resume_until: int | None = None
        self._since_early: list[np.ndarray] = []
        self._max_frames = max(1, int(config.max_utterance_s * 1000 / frame_ms))
        self._pre: deque[np.ndarray] = deque(maxlen=max(0, math.ceil(config.pre_roll_ms / frame_ms)) + self._min_voiced)
        self._pending = np.zeros(0, np.float32)
        self._pos = 0  # samples framed so far
        self.speaking = False
        self._voiced_run = 0
        self._silence_run = 0
        self._frames_in = 0
        self._last_voiced_end = 0

    def push(self, block: np.ndarray) -> list[Event]:
        x = np.concatenate([self._pending, np.asarray(block, np.float32).reshape(-1)])
        events: list[Event] = []
        n = x.size // self.frame
        for i in range(n):
            self._frame(x[i * self.frame : (i + 1) * self.frame], events)
        self._pending = x[n * self.frame :]
        return _merge_audio(events)

    def flush(self) -> list[Event]:
        """End of stream: the partial last frame goes to an open utterance, which then ends."""
        events: list[Event] = []
        if self.detector is None and not self.speaking and self._pending.size:
            # A stream shorter than one frame is still an utterance when there is no VAD.
            events.append(SpeechStart(self._pos / self.rate, np.concatenate([*self._pre, self._pending])))
            self._pos += self._pending.size
            self._pending = np.zeros(0, np.float32)
            self._last_voiced_end = self._pos
            self.speaking = True
        if self.speaking:
            if self._pending.size:
                events.append(SpeechAudio(self._pending))
                self._pos += self._pending.size
            events.append(SpeechEnd(self._pos / self.rate, self._last_voiced_end / self.rate, "end_of_stream"))
            self.speaking = False
        self._pending = np.zeros(0, np.float32)
        return _merge_audio(events)

    @property
    def voiced_samples(self) -> int:
        """Samples of the current utterance's audio (pre-roll included) up to the end of its last voiced frame."""
        return self._last_voiced_end - self._utt_start

    @property
    def last_voiced_end(self) -> int:
        """The stream sample where the latest voiced frame ended (``SpeechEnd.speech_end_s`` × rate)."""
        return self._last_voiced_end

    @property
    def silence_ms(self) -> float:
        """The trailing silence of the current utterance so far (0 when idle)."""
        return 1000 * self._silence_run * self.frame / self.rate if self.speaking else 0.0

    def _frame(self, frame: np.ndarray, events: list[Event]) -> None:
        voiced = self.detector.is_speech(frame) if self.detector else True
        self._pos += frame.size
        if not self.speaking:
            self._pre.append(frame)
            self._voiced_run = self._voiced_run + 1 if voiced else 0
            if self._resume_until is not None:
                self._since_early.append(frame)
                if self._voiced_run == 0 and self._pos >= self._resume_until:
                    self._resume_until, self._since_early = None, []  # the full wait is over: a new utterance
            if self._voiced_run >= self._min_voiced:
                onset = self._pos - self._voiced_run * self.frame
                resumes = self._resume_until is not None and onset < self._resume_until
                audio = self._since_early if resumes else list(self._pre)
                self._utt_start = self._pos - sum(a.size for a in audio)
                events.append(SpeechStart(onset / self.rate, np.concatenate(audio), resumes))
                self._resume_until, self._since_early = None, []
                self._pre.clear()
                self.speaking, self._silence_run, self._voiced_run = True, 0, 0
                self._frames_in = self._min_voiced
                self._last_voiced_end = self._pos
            return
        events.append(SpeechAudio(frame))
        self._frames_in += 1
        if voiced:
            self._silence_run = 0
            self._last_voiced_end = self._pos
        else:
            self._silence_run += 1
        reason: Literal["silence", "max_length", "early"] | None = None
        if self._silence_run >= self._max_silence:
            reason = "silence"
        elif self._frames_in >= self._max_frames:
            reason = "max_length"
        elif self._early_ends() and self.complete is not None and self.complete(self.voiced_samples):
            reason = "early"
        if reason:
            events.append(SpeechEnd(self._pos / self.rate, self._last_voiced_end / self.rate, reason))
            # after an early end, speech within the rest of the full wait continues the utterance
            left = (self._max_silence - self._silence_run) * self.frame
            self._resume_until = self._pos + left if reason == "early" else None
            self._since_early = []
            self.speaking, self._silence_run = False, 0

    def _early_ends(self) -> bool:
        return self._early_silence is not None and self._silence_run >= self._early_silence


def _merge_audio(events: list[Event]) -> list[Event]:
    """Adjacent SpeechAudio events become one (fewer, larger blocks downstream)."""
    out: list[Event] = []
    run: list[np.ndarray] = []
    for e in events:
        if isinstance(e, SpeechAudio):
            run.append(e.audio)
            continue
        if run:
            out.append(SpeechAudio(np.concatenate(run)))
            run = []
        out.append(e)
    if run:
        out.append(SpeechAudio(np.concatenate(run)))
    return out
