"""CTC speech recognition: one shared engine, per-stream state, a batched ``step(streams)``.

Two model kinds (docs/asr-models.md):

- **stateless** (wav2vec2-CTC, ``demo-ctc``): ``input_values`` [B, samples] → ``logits`` [B, T, V].
  The encoder attends over the whole input (and its group-norm front end normalises over time),
  so a stream re-runs the model on its growing utterance each step; the final is the
  whole-utterance pass itself. Rows batch together only when their windows have the same length:
  the export has no attention mask, and zero padding would change every frame.
- **stateful streaming CTC** (``model_type`` ``streaming-ctc``, ``demo-asr``): log-mel ``features``
  [B, frames, F] plus carried ``state_in.*`` → ``log_probs`` + ``state_out.*``. A stream computes
  its features incrementally, runs each ``chunk_frames`` chunk once with its state, then what is
  left over in whole multiples of ``subsampling`` (at least ``min_chunk_frames``), so a step never
  sits on audio it could already decode (the first partial does not wait for a whole chunk), and
  decodes incrementally; at the end it feeds its last frames (padded to a multiple of
  ``subsampling``) and ``flush_frames`` of ``padding_value``. The model's contract makes the
  outputs independent of how frames are split into calls (docs/asr-models.md). Chunks of all
  streams batch exactly: same shape, states stacked on the batch axis.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from ..backends import Session, SessionOptions, npu, open_session
from ..errors import ModelError
from .catalog import ModelRef
from .ctc_decode import CtcVocab, Decoder, GreedyDecoder, log_softmax
from .ctc_lexicon import decoder_factory
from .recognizer import AudioStream, Hypothesis, read_json

if TYPE_CHECKING:
    from ..audio.features import FeatureStream

log = logging.getLogger(__name__)


class CtcStream(AudioStream):
    """One utterance's state in a CTC recogniser: its audio or features so far and its decoder."""

    def __init__(self, rate: int, decoder: Decoder) -> None:
        super().__init__(rate)
        self.decoder = decoder
        self.audio: list[np.ndarray] = []  # stateless: the utterance so far
        self.total = 0
        self.decoded_at = -1  # stateless: samples covered by the last run
        self.last_decoder: Decoder | None = None  # stateless: the decode of the last run
        self.features: FeatureStream | None = None  # stateful only
        self.feat_buf = np.zeros((0, 0), np.float32)
        self.state: dict[str, np.ndarray] = {}

    def fork(self) -> CtcStream:
        """A copy that goes on alone from here: its audio (taken and pending), features, model state and
        decoder so far, sharing only what every stream shares (the lexicon, the language model, the
        feature kernel). Ended and stepped, it says what this stream's final would say if it ended now.
        Only while no step of this stream runs."""
        shared = [self._lock, getattr(self.decoder, "lexicon", None), getattr(self.decoder, "lm", None)]
        if self.features is not None:
            shared += [self.features.cfg, getattr(self.features, "_kernel", None)]
        memo = {id(o): o for o in shared if o is not None}
        with self._lock:
            twin = copy.deepcopy(self, memo)
        twin._lock = threading.Lock()
        return twin


class CtcRecognizer:
    """A CTC recogniser, stateless (wav2vec2) or stateful streaming, with a greedy, lexicon or LM decoder."""

    kind = "ctc"

    def __init__(self, ref: ModelRef, session: Session, decoder: str = "auto", beam_width: int | None = None) -> None:
        self.ref, self.session, self.name = ref, session, ref.name
        self.vocab = CtcVocab.from_folder(ref.path, ref.config)
        # auto: the folder's lexicon + LM when it ships them (ctc_lexicon.py), else greedy
        self.decoder_kind, new_decoder = decoder_factory(decoder, self.vocab, Path(ref.path), ref.config, beam_width)
        self._new_decoder = cast("Callable[[], Decoder]", new_decoder)  # every kind is a Decoder
        pre = read_json(ref.path / "preprocessor_config.json")
        names = {s.name for s in session.inputs}
        self.stateful = ref.model_type == "streaming-ctc" or "features" in names
        self.sample_rate = int(pre.get("sampling_rate", 16000))
        if self.sample_rate != 16000:
            raise ModelError(f"{ref.name}: sampling_rate {self.sample_rate}; the agent feeds 16 kHz audio")
        # static input shapes (the NPU): every call is [batch, frames] exactly (see _run_fixed)
        self.fixed_shape: tuple[int, int] | None = None
        if self.stateful:
            self.kind = "streaming-ctc"
            self._init_stateful(pre)
        else:
            if "input_values" not in names:
                raise ModelError(
                    f"{ref.name}: a CTC model takes input_values (wav2vec2) or features "
                    f"(streaming-ctc); this one takes {sorted(names)}"
                )
            self.do_normalize = bool(pre.get("do_normalize", True))
            self.min_samples = _receptive_field(ref.config)
            self.max_utterance_s = 30.0

    def _init_stateful(self, pre: dict) -> None:
        from ..audio.features import LogMelConfig

        cfg = self.ref.config
        try:
            self.feature_cfg = LogMelConfig.from_preprocessor(pre or self.ref.path)
        except ValueError as exc:
            raise ModelError(f"{self.ref.name}: preprocessor_config.json: {exc}") from exc
        self.subsampling = int(cfg.get("subsampling", 1))
        self.chunk_frames = int(cfg.get("chunk_frames", 32))
        self.flush_frames = int(cfg.get("flush_frames", 0))
        # the smallest call a step makes with the frames left after its whole chunks (chunk_frames:
        # wait for whole chunks only, the behaviour before steps ran partial chunks)
        self.min_chunk_frames = self.subsampling
        if self.chunk_frames % self.subsampling:
            raise ModelError(
                f"{self.ref.name}: chunk_frames {self.chunk_frames} is not a multiple of subsampling {self.subsampling}"
            )
        shapes = cfg.get("state_shapes") or {}
        self.state_shapes: dict[str, tuple[int, ...]] = {}
        for spec in self.session.inputs:
            if spec.name.startswith("state_in."):
                shape = shapes.get(spec.name) or [d for d in spec.shape[1:]]
                if not all(isinstance(d, int) for d in shape):
                    raise ModelError(
                        f"{self.ref.name}: {spec.name} has dynamic dims {spec.shape} and "
                        "config.json state_shapes does not give them"
                    )
                self.state_shapes[spec.name] = tuple(int(d) for d in shape)
        self.max_utterance_s = float("inf")  # state carries context; no window to outgrow
        features = next((spec for spec in self.session.inputs if spec.name == "features"), None)
        if features is not None and features.is_static:
            batch, frames = int(features.shape[0]), int(features.shape[1])  # type: ignore[arg-type]  # static
            if frames % self.subsampling:
                raise ModelError(f"{self.ref.name}: a static chunk of {frames} frames is not whole subsampling groups")
            # Only whole chunks run while the audio goes on (a padded one would carry padding in the state);
            # the tail is padded to whole chunks and the padding's output frames dropped.
            self.fixed_shape = (batch, frames)
            self.chunk_frames = self.min_chunk_frames = frames

    @classmethod
    def open(
        cls,
        ref: ModelRef,
        backend: str = "onnxruntime",
        options: SessionOptions | None = None,
        decoder: str = "auto",
        beam_width: int | None = None,
        **_: object,
    ) -> CtcRecognizer:
        path = Path(ref.path) / "model.onnx"
        if not path.is_file():
            raise ModelError(f"{ref.path}: missing model.onnx")
        options = options or SessionOptions()
        if backend == "openvino" and npu.is_npu(options.device) and not options.static_shapes:
            options = replace(options, static_shapes=npu_chunk_shapes(ref))
        session = open_session(path, backend, options, warmup=lambda s: None)
        engine = cls(ref, session, decoder, beam_width)
        engine.transcribe(np.zeros(engine.sample_rate // 2, np.float32))  # real warm-up: first request is honest
        return engine

    def new_stream(self) -> CtcStream:
        s = CtcStream(self.sample_rate, self._new_decoder())
        if self.stateful:
            from ..audio.features import FeatureStream

            s.features = FeatureStream(self.feature_cfg)
            s.feat_buf = np.zeros((0, self.feature_cfg.num_mel_bins), np.float32)
            s.state = {n: np.zeros((1, *shape), np.float32) for n, shape in self.state_shapes.items()}
        return s

    def step(self, streams: Sequence[CtcStream]) -> list[Hypothesis | None]:
        return self._step_stateful(streams) if self.stateful else self._step_stateless(streams)

    # -- stateless: re-run on the growing utterance ------------------------------------------

    def _normalize(self, x: np.ndarray) -> np.ndarray:
        if not self.do_normalize:
            return x.astype(np.float32)
        # Wav2Vec2FeatureExtractor: zero mean, unit variance over the utterance.
        return ((x - x.mean()) / np.sqrt(x.var() + 1e-7)).astype(np.float32)

    def _logits(self, windows: list[np.ndarray]) -> np.ndarray:
        batch = np.stack([self._normalize(w) for w in windows])
        return self.session.run({"input_values": batch}, ["logits"])["logits"]

    def _step_stateless(self, streams: Sequence[CtcStream]) -> list[Hypothesis | None]:
        results: list[Hypothesis | None] = [None] * len(streams)
        groups: dict[int, list[int]] = defaultdict(list)
        # whether each stream had ended when its audio was taken: audio and end() may arrive while
        # this step runs, and a final must not leave out audio it never took
        ended_at: dict[int, bool] = {}
        for i, s in enumerate(streams):
            new, ended = s.take()
            ended_at[i] = ended
            if new.size:
                s.audio.append(new)
                s.total += new.size
            if s.finished:
                continue
            if s.total < self.min_samples:
                if ended:  # too short to produce a frame: an empty final, never a hang
                    s.finished = True
                    results[i] = Hypothesis("", (), True, "", s.total / self.sample_rate)
                continue
            if ended and s.total == s.decoded_at:  # nothing new since the last pass: it is the final
                s.finished = True
                decoder = s.last_decoder or GreedyDecoder(self.vocab.blank_id)
                decoder.finish()
                text = self.vocab.text(decoder.ids)
                results[i] = Hypothesis(text, decoder.ids, True, text, s.total / self.sample_rate)
            elif s.total != s.decoded_at:
                groups[s.total].append(i)
        for length, rows in groups.items():
            windows = []
            for i in rows:
                s = streams[i]
                s.audio = [np.concatenate(s.audio)] if len(s.audio) > 1 else s.audio
                windows.append(s.audio[0])
            logits = self._logits(windows)
            for j, i in enumerate(rows):
                s = streams[i]
                decoder = self._new_decoder()
                decoder.advance(log_softmax(logits[j]))
                s.decoded_at, s.last_decoder = length, decoder
                final = ended_at[i]
                s.finished = final
                if final:
                    decoder.finish()
                text = self.vocab.text(decoder.ids)
                stable = text if final else self.vocab.text(decoder.stable_ids)
                results[i] = Hypothesis(text, decoder.ids, final, stable, length / self.sample_rate)
        return results

    # -- stateful: chunks with carried state -------------------------------------------------

    def _run_chunks(self, streams: list[CtcStream], chunks: list[np.ndarray]) -> None:
        if self.fixed_shape is not None:
            self._run_fixed(streams, chunks, *self.fixed_shape)
            return
        feeds = {"features": np.stack(chunks).astype(np.float32)}
        for name in self.state_shapes:
            feeds[name] = np.concatenate([s.state[name] for s in streams])
        out = self.session.run(feeds)
        for j, s in enumerate(streams):
            for name in self.state_shapes:
                s.state[name] = out[name.replace("state_in.", "state_out.", 1)][j : j + 1]
            s.decoder.advance(out["log_probs"][j])

    def _run_fixed(self, streams: list[CtcStream], chunks: list[np.ndarray], batch: int, frames: int) -> None:
        """``_run_chunks`` on static shapes: streams in groups of ``batch`` (empty rows padded with zero
        state), chunks in pieces of ``frames`` (the state carried from one to the next); a short piece is
        padded and only the output frames of its real frames are kept."""
        pad = self.feature_cfg.padding_value
        for first in range(0, len(streams), batch):
            group, parts = streams[first : first + batch], chunks[first : first + batch]
            for offset in range(0, max(c.shape[0] for c in parts), frames):
                rows = [(s, c[offset : offset + frames]) for s, c in zip(group, parts) if c.shape[0] > offset]
                feats = np.full((batch, frames, self.feature_cfg.num_mel_bins), pad, np.float32)
                feeds: dict[str, np.ndarray] = {"features": feats}
                for j, (_s, piece) in enumerate(rows):
                    feats[j, : piece.shape[0]] = piece
                for name, shape in self.state_shapes.items():
                    state = np.zeros((batch, *shape), np.float32)
                    for j, (s, _piece) in enumerate(rows):
                        state[j] = s.state[name][0]
                    feeds[name] = state
                out = self.session.run(feeds)
                for j, (s, piece) in enumerate(rows):
                    for name in self.state_shapes:
                        s.state[name] = out[name.replace("state_in.", "state_out.", 1)][j : j + 1]
                    s.decoder.advance(out["log_probs"][j][: piece.shape[0] // self.subsampling])

    def _tail(self, s: CtcStream) -> np.ndarray:
        cfg, sub = self.feature_cfg, self.subsampling
        tail = s.feat_buf
        pad = (-tail.shape[0]) % sub + self.flush_frames
        return np.concatenate([tail, np.full((pad, cfg.num_mel_bins), cfg.padding_value, np.float32)])

    def _step_stateful(self, streams: Sequence[CtcStream]) -> list[Hypothesis | None]:
        results: list[Hypothesis | None] = [None] * len(streams)
        active = []
        ended_at: set[int] = set()  # ended when its audio was taken (not later, mid-step: see below)
        for i, s in enumerate(streams):
            new, ended = s.take()
            if ended:
                ended_at.add(i)
            if s.finished:
                continue
            if new.size and s.features is not None:  # a stateful engine's streams all have features
                s.total += new.size
                s.feat_buf = np.concatenate([s.feat_buf, s.features.push(new)])
            active.append(i)
        advanced: set[int] = set()
        n = self.chunk_frames
        while True:  # round by round: every stream with a whole chunk runs in the same batch
            ready = [i for i in active if streams[i].feat_buf.shape[0] >= n]
            if not ready:
                break
            chunks = [streams[i].feat_buf[:n] for i in ready]
            for i in ready:
                streams[i].feat_buf = streams[i].feat_buf[n:]
            self._run_chunks([streams[i] for i in ready], chunks)
            advanced.update(ready)
        # What is left (less than a chunk) runs now too, in whole subsampling groups, batched by length;
        # an ending stream's rest goes with its tail below, in one call.
        rest: dict[int, list[int]] = defaultdict(list)
        for i in active:
            left = streams[i].feat_buf.shape[0] // self.subsampling * self.subsampling
            if i not in ended_at and left and left >= self.min_chunk_frames:
                rest[left].append(i)
        for left, rows in rest.items():
            chunks = [streams[i].feat_buf[:left] for i in rows]
            for i in rows:
                streams[i].feat_buf = streams[i].feat_buf[left:]
            self._run_chunks([streams[i] for i in rows], chunks)
            advanced.update(rows)
        # Only a stream that had ended when its audio was taken ends now: one that end()ed while this
        # step ran may have audio added after the take, which its next step (the final) must decode.
        ending = [i for i in active if i in ended_at]
        groups: dict[int, list[int]] = defaultdict(list)
        tails = {i: self._tail(streams[i]) for i in ending}
        for i, tail in tails.items():
            groups[tail.shape[0]].append(i)
        for length, rows in groups.items():
            if length:
                self._run_chunks([streams[i] for i in rows], [tails[i] for i in rows])
            for i in rows:
                streams[i].feat_buf = streams[i].feat_buf[:0]
                streams[i].finished = True
                advanced.add(i)
        for i in sorted(advanced):
            s = streams[i]
            if s.finished:
                s.decoder.finish()
            ids = s.decoder.ids
            text = self.vocab.text(ids)
            stable = text if s.finished else self.vocab.text(s.decoder.stable_ids)
            results[i] = Hypothesis(text, ids, s.finished, stable, s.total / self.sample_rate)
        return results

    # -- one pass ------------------------------------------------------------------------------

    def transcribe(self, samples: np.ndarray) -> Hypothesis:
        """The whole utterance in one model call (the non-streaming reference)."""
        x = np.asarray(samples, np.float32).reshape(-1)
        decoder = self._new_decoder()
        if self.stateful:
            from ..audio.features import log_mel

            s = self.new_stream()
            s.feat_buf = log_mel(x, self.feature_cfg)
            s.decoder = decoder
            self._run_chunks([s], [self._tail(s)])
        elif x.size >= self.min_samples:
            decoder.advance(log_softmax(self._logits([x])[0]))
        decoder.finish()
        text = self.vocab.text(decoder.ids)
        return Hypothesis(text, decoder.ids, True, text, x.size / self.sample_rate)

    def frame_scores(self, samples: np.ndarray) -> np.ndarray:
        """Per-frame scores of one whole-utterance pass (logits or log_probs), for checks and tests."""
        x = np.asarray(samples, np.float32).reshape(-1)
        if self.stateful:
            from ..audio.features import log_mel

            s = self.new_stream()
            s.feat_buf = log_mel(x, self.feature_cfg)
            if self.fixed_shape is not None:  # through static chunks, the frames collected as they come
                frames: list[np.ndarray] = []
                s.decoder = _Collect(frames)  # type: ignore[assignment]  # only advance() is called
                self._run_chunks([s], [self._tail(s)])
                return np.concatenate(frames)
            return self.session.run({"features": self._tail(s)[None], **s.state})["log_probs"][0]
        return self._logits([x])[0]

    def close(self) -> None:
        self.session.close()


class _Collect:
    """A decoder stand-in that keeps the log-prob frames it is given (``frame_scores``)."""

    def __init__(self, frames: list[np.ndarray]) -> None:
        self.frames = frames

    def advance(self, log_probs: np.ndarray) -> None:
        self.frames.append(log_probs)


def npu_chunk_shapes(ref: ModelRef) -> dict[str, tuple[int, ...]]:
    """The static shapes a streaming CTC model runs with on the NPU: one stream, one chunk of its own
    ``chunk_frames`` (the tail is padded to whole chunks), its states."""
    cfg = ref.config
    if ref.model_type != "streaming-ctc" or "state_shapes" not in cfg:
        raise ModelError(
            f"{ref.name}: the NPU runs static shapes, and only a streaming CTC model (config.json chunk_frames and "
            "state_shapes) keeps them for a whole utterance: serve this model on the CPU"
        )
    pre = read_json(Path(ref.path) / "preprocessor_config.json")
    mels = int(pre.get("feature_size") or pre.get("num_mel_bins") or 80)
    shapes: dict[str, tuple[int, ...]] = {"features": (1, int(cfg.get("chunk_frames", 32)), mels)}
    for name, shape in cfg["state_shapes"].items():
        shapes[name] = (1, *(int(d) for d in shape))
    return shapes


def _receptive_field(config: dict) -> int:
    """Fewest samples that give one output frame (400 for wav2vec2's conv front end)."""
    kernels, strides = config.get("conv_kernel"), config.get("conv_stride")
    if not kernels or not strides:
        return 400
    field, jump = 1, 1
    for k, s in zip(kernels, strides):
        field += (k - 1) * jump
        jump *= s
    return field
