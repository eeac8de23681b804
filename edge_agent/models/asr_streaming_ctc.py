"""A small runner for stateful streaming CTC models (``model_type`` ``"streaming-ctc"``, ``demo-asr``).

It follows ``docs/asr-models.md``: log-mel ``features`` in chunks of ``chunk_frames`` with the
``state_in.*`` → ``state_out.*`` tensors carried per stream, ``flush_frames`` frames of
``padding_value`` at the end, per-frame ``log_probs`` out. One stream per call (no batching): it
serves evaluation and the accuracy checks; the serving recogniser (``asr_ctc.py``) batches streams.

Decoders:
- ``greedy``: argmax per frame, merge repeats, drop blanks;
- ``lexicon``: the lexicon-constrained CTC beam search of ``ctc_lexicon.py`` (only words of the
  folder's ``lexicon.txt``);
- ``lm``: the same search scored by the folder's n-gram language model ``lm.arpa``
  (``lm_weight``, ``lm_word_bonus`` and ``lm_beam`` from ``config.json``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ..audio.features import FeatureStream, LogMelConfig, log_mel
from ..backends import Session, SessionOptions, open_session
from ..errors import InputError, ModelError
from .ctc_decode import greedy_ids
from .ctc_lexicon import Lexicon, LexiconBeamDecoder, NgramLM, decode_all, read_language

Decoder = Literal["greedy", "lexicon", "lm"]


@dataclass(frozen=True, slots=True)
class StreamingCtcSpec:
    """What the model folder says about the model (config.json, vocab.json, preprocessor, lexicon)."""

    folder: Path
    tokens: tuple[str, ...]  # id → token
    blank_id: int
    word_delimiter: str
    subsampling: int
    chunk_frames: int
    flush_frames: int
    state_shapes: dict[str, tuple[int, ...]]  # state_in.i → shape without the batch dim
    features: LogMelConfig
    lexicon: Lexicon | None
    lm: NgramLM | None = None
    beam: int = 12  # lexicon/lm beam width

    @classmethod
    def from_folder(cls, folder: Path) -> StreamingCtcSpec:
        def read(name: str) -> dict:
            path = folder / name
            try:
                return json.loads(path.read_text())
            except FileNotFoundError:
                raise ModelError(
                    f"{folder}: missing {name} (a streaming CTC folder has config.json, vocab.json, "
                    f"preprocessor_config.json and model.onnx)"
                ) from None
            except json.JSONDecodeError as exc:
                raise ModelError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc

        config, vocab = read("config.json"), read("vocab.json")
        if config.get("model_type") != "streaming-ctc":
            raise ModelError(f"{folder}: config.json model_type is {config.get('model_type')!r}, not 'streaming-ctc'")
        try:
            lexicon, lm, beam = read_language(folder, config)
            features = LogMelConfig.from_preprocessor(read("preprocessor_config.json"))
            tokens = [""] * len(vocab)
            for token, i in vocab.items():
                tokens[int(i)] = token
            spec = cls(
                folder=folder,
                tokens=tuple(tokens),
                blank_id=int(config["blank_id"]),
                word_delimiter=str(config.get("word_delimiter", "|")),
                subsampling=int(config["subsampling"]),
                chunk_frames=int(config["chunk_frames"]),
                flush_frames=int(config["flush_frames"]),
                state_shapes={k: tuple(int(d) for d in v) for k, v in config["state_shapes"].items()},
                features=features,
                lexicon=lexicon,
                lm=lm,
                beam=beam,
            )
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise ModelError(f"{folder}: incomplete streaming CTC config: {exc!r}") from exc
        if spec.chunk_frames % spec.subsampling or spec.flush_frames % spec.subsampling:
            raise ModelError(f"{folder}: chunk_frames and flush_frames must be multiples of subsampling")
        return spec


@dataclass(slots=True)
class CtcStream:
    """One utterance in flight: feature stream, frames not yet run, model state, outputs so far."""

    features: FeatureStream
    state: dict[str, np.ndarray]
    pending: np.ndarray  # [frames, mels] waiting for a full chunk
    log_probs: list[np.ndarray] = field(default_factory=list)
    chunk_ms: list[float] = field(default_factory=list)  # compute time of each model call
    finished: bool = False


class StreamingCtcRunner:
    """Open a streaming CTC folder on a backend; run utterances streamed or whole; decode."""

    def __init__(self, folder: str | Path, backend: str = "onnxruntime", options: SessionOptions | None = None) -> None:
        self.spec = StreamingCtcSpec.from_folder(Path(folder))
        self._delimiter_id = self.spec.tokens.index(self.spec.word_delimiter)
        self.session: Session = open_session(self.spec.folder / "model.onnx", backend, options, warmup=self._warmup)

    def _warmup(self, session: Session) -> None:
        frames = np.full(
            (1, self.spec.chunk_frames, self.spec.features.num_mel_bins), self.spec.features.padding_value, np.float32
        )
        session.run({"features": frames, **self._zero_state()})

    def _zero_state(self) -> dict[str, np.ndarray]:
        return {name: np.zeros((1, *shape), np.float32) for name, shape in self.spec.state_shapes.items()}

    def close(self) -> None:
        self.session.close()

    # -- running -----------------------------------------------------------------------------

    def start(self) -> CtcStream:
        cfg = self.spec.features
        return CtcStream(FeatureStream(cfg), self._zero_state(), np.zeros((0, cfg.num_mel_bins), np.float32))

    def _run(self, stream: CtcStream, frames: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.session.run({"features": frames[None], **stream.state})
        stream.chunk_ms.append((time.perf_counter() - t0) * 1e3)
        stream.state = {name: out[name.replace("state_in", "state_out")] for name in stream.state}
        stream.log_probs.append(out["log_probs"][0])
        return out["log_probs"][0]

    def push(self, stream: CtcStream, samples: np.ndarray) -> np.ndarray:
        """Feed audio (float32 mono at the model's rate); returns the log-probs of the chunks it completed."""
        if stream.finished:
            raise InputError("this stream is finished; start a new one")
        stream.pending = np.concatenate([stream.pending, stream.features.push(samples)])
        n = self.spec.chunk_frames
        new = []
        while stream.pending.shape[0] >= n:
            new.append(self._run(stream, stream.pending[:n]))
            stream.pending = stream.pending[n:]
        return np.concatenate(new) if new else np.zeros((0, len(self.spec.tokens)), np.float32)

    def _tail(self, frames: np.ndarray) -> np.ndarray:
        """Frames padded to a multiple of the subsampling, then the flush frames."""
        spec = self.spec
        total = math.ceil(frames.shape[0] / spec.subsampling) * spec.subsampling + spec.flush_frames
        out = np.full((total, frames.shape[1]), spec.features.padding_value, np.float32)
        out[: frames.shape[0]] = frames
        return out

    def finish(self, stream: CtcStream) -> np.ndarray:
        """Flush the stream; returns every log-prob frame of the utterance ``[frames, vocab]``."""
        if not stream.finished:
            self._run(stream, self._tail(stream.pending))
            stream.pending = stream.pending[:0]
            stream.finished = True
        return np.concatenate(stream.log_probs)

    def stream(self, samples: np.ndarray, chunk_samples: int = 1600) -> tuple[np.ndarray, CtcStream]:
        """The whole utterance fed as audio chunks (100 ms by default), as a microphone would."""
        s = self.start()
        for i in range(0, len(samples), chunk_samples):
            self.push(s, samples[i : i + chunk_samples])
        return self.finish(s), s

    def full(self, samples: np.ndarray) -> np.ndarray:
        """The whole utterance in one model call (the reference the streamed result must equal)."""
        frames = self._tail(log_mel(samples, self.spec.features))
        return self.session.run({"features": frames[None], **self._zero_state()})["log_probs"][0]

    # -- decoding ----------------------------------------------------------------------------

    def decode(
        self, log_probs: np.ndarray, decoder: Decoder = "greedy", beam: int | None = None, lm: NgramLM | None = None
    ) -> str:
        """Text of an utterance's log-probs; ``lm`` overrides the folder's (weights being tuned)."""
        if decoder == "greedy":
            return self.text(list(greedy_ids(log_probs, self.spec.blank_id)))
        return self.text(list(decode_all(self.search(decoder, beam, lm), log_probs)))

    def search(self, decoder: Decoder, beam: int | None = None, lm: NgramLM | None = None) -> LexiconBeamDecoder:
        """A fresh incremental lexicon (``lm``: and language-model) beam search over this folder's words."""
        if self.spec.lexicon is None:
            raise ModelError(f"{self.spec.folder}: no lexicon.txt, so no lexicon-constrained decoding")
        if decoder == "lm":
            lm = lm or self.spec.lm
            if lm is None:
                raise ModelError(f"{self.spec.folder}: no lm.arpa, so no language-model decoding")
        else:
            lm = None
        return LexiconBeamDecoder(
            self.spec.tokens, self.spec.blank_id, self._delimiter_id, self.spec.lexicon, beam or self.spec.beam, lm=lm
        )

    def text(self, ids: list[int]) -> str:
        """The words of label ids (specials dropped, the word delimiter as spaces)."""
        text = "".join(self.spec.tokens[i] for i in ids if not self.spec.tokens[i].startswith("<"))
        return " ".join(text.replace(self.spec.word_delimiter, " ").split())
