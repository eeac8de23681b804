"""A small runner for stateful streaming CTC models (``model_type`` ``"streaming-ctc"``, ``demo-asr``).

It follows ``docs/asr-models.md``: log-mel ``features`` in chunks of ``chunk_frames`` with the
``state_in.*`` → ``state_out.*`` tensors carried per stream, ``flush_frames`` frames of
``padding_value`` at the end, per-frame ``log_probs`` out. One stream per call (no batching): it
serves evaluation and the accuracy checks; the serving recogniser (``asr_ctc.py``) batches streams.

Decoders:
- ``greedy``: argmax per frame, merge repeats, drop blanks;
- ``lexicon``: a CTC prefix beam search in which every word must be spelled along a path of the
  model folder's ``lexicon.txt`` (one word per line): the output can only contain known words;
  a word boundary is the ``word_delimiter`` token;
- ``lm``: the same search, with each completed word also scored by the folder's word bigram
  language model (``lm.arpa``, standard ARPA format) as ``lm_weight · ln P(word | previous) +
  lm_word_bonus`` (both from ``config.json``; defaults 0.5 and 1.0).
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
    lexicon: frozenset[str] | None
    lm: BigramLM | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> StreamingCtcSpec:
        def read(name: str) -> dict:
            path = folder / name
            try:
                return json.loads(path.read_text())
            except FileNotFoundError:
                raise ModelError(f"{folder}: missing {name} (a streaming CTC folder has config.json, vocab.json, "
                                 f"preprocessor_config.json and model.onnx)") from None
            except json.JSONDecodeError as exc:
                raise ModelError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc

        config, vocab = read("config.json"), read("vocab.json")
        if config.get("model_type") != "streaming-ctc":
            raise ModelError(f"{folder}: config.json model_type is {config.get('model_type')!r}, not 'streaming-ctc'")
        try:
            features = LogMelConfig.from_preprocessor(read("preprocessor_config.json"))
            tokens = [""] * len(vocab)
            for token, i in vocab.items():
                tokens[int(i)] = token
            spec = cls(
                folder=folder, tokens=tuple(tokens), blank_id=int(config["blank_id"]),
                word_delimiter=str(config.get("word_delimiter", "|")), subsampling=int(config["subsampling"]),
                chunk_frames=int(config["chunk_frames"]), flush_frames=int(config["flush_frames"]),
                state_shapes={k: tuple(int(d) for d in v) for k, v in config["state_shapes"].items()},
                features=features, lexicon=_read_lexicon(folder / "lexicon.txt"),
                lm=_read_lm(folder / "lm.arpa", config),
            )
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise ModelError(f"{folder}: incomplete streaming CTC config: {exc!r}") from exc
        if spec.chunk_frames % spec.subsampling or spec.flush_frames % spec.subsampling:
            raise ModelError(f"{folder}: chunk_frames and flush_frames must be multiples of subsampling")
        return spec


@dataclass(frozen=True, slots=True)
class BigramLM:
    """A word bigram model read from an ARPA file (log10 probabilities and back-off weights)."""

    unigrams: dict[str, tuple[float, float]]  # word -> (log10 p, log10 back-off)
    bigrams: dict[tuple[str, str], float]  # (previous, word) -> log10 p
    weight: float = 0.5
    word_bonus: float = 1.0

    @classmethod
    def from_arpa(cls, path: Path, weight: float = 0.5, word_bonus: float = 1.0) -> BigramLM:
        unigrams: dict[str, tuple[float, float]] = {}
        bigrams: dict[tuple[str, str], float] = {}
        order = 0
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("ngram ") or line in ("\\data\\", "\\end\\"):
                continue
            if line.startswith("\\") and line.endswith("-grams:"):
                order = int(line[1:line.index("-")])
                continue
            parts = line.split()
            try:
                if order == 1:
                    unigrams[parts[1]] = (float(parts[0]), float(parts[2]) if len(parts) > 2 else 0.0)
                elif order == 2:
                    bigrams[(parts[1], parts[2])] = float(parts[0])
            except (IndexError, ValueError):
                raise ModelError(f"{path}:{number}: not an ARPA n-gram line: {raw!r}") from None
        if not unigrams:
            raise ModelError(f"{path}: no unigrams (not an ARPA language model?)")
        return cls(unigrams, bigrams, weight, word_bonus)

    def score(self, prev: str, word: str) -> float:
        """Natural-log P(word | prev), backing off to the unigram; unknown words get the <unk> score."""
        p = self.bigrams.get((prev, word))
        if p is None:
            unk = self.unigrams.get("<unk>", (-7.0, 0.0))
            p = self.unigrams.get(prev, (0.0, 0.0))[1] + self.unigrams.get(word, unk)[0]
        return p * math.log(10.0)


def _read_lm(path: Path, config: dict) -> BigramLM | None:
    if not path.is_file():
        return None
    return BigramLM.from_arpa(path, float(config.get("lm_weight", 0.5)), float(config.get("lm_word_bonus", 1.0)))


def _read_lexicon(path: Path) -> frozenset[str] | None:
    if not path.is_file():
        return None
    return frozenset(w for w in (line.strip() for line in path.read_text().splitlines()) if w and not w.startswith("#"))


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
        frames = np.full((1, self.spec.chunk_frames, self.spec.features.num_mel_bins), self.spec.features.padding_value,
                         np.float32)
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
            self.push(s, samples[i:i + chunk_samples])
        return self.finish(s), s

    def full(self, samples: np.ndarray) -> np.ndarray:
        """The whole utterance in one model call (the reference the streamed result must equal)."""
        frames = self._tail(log_mel(samples, self.spec.features))
        return self.session.run({"features": frames[None], **self._zero_state()})["log_probs"][0]

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, log_probs: np.ndarray, decoder: Decoder = "greedy", beam: int = 12) -> str:
        if decoder == "greedy":
            return self._text(greedy_ids(log_probs, self.spec.blank_id))
        if self.spec.lexicon is None:
            raise ModelError(f"{self.spec.folder}: no lexicon.txt, so no lexicon-constrained decoding")
        lm = None
        if decoder == "lm":
            if self.spec.lm is None:
                raise ModelError(f"{self.spec.folder}: no lm.arpa, so no language-model decoding")
            lm = self.spec.lm
        return lexicon_beam_search(log_probs, self.spec.tokens, self.spec.blank_id, self._delimiter_id,
                                   self.spec.lexicon, beam, lm=lm)

    def _text(self, ids: list[int]) -> str:
        text = "".join(self.spec.tokens[i] for i in ids if not self.spec.tokens[i].startswith("<"))
        return " ".join(text.replace(self.spec.word_delimiter, " ").split())


def greedy_ids(log_probs: np.ndarray, blank_id: int) -> list[int]:
    best = log_probs.argmax(axis=-1)
    keep = np.ones(best.shape[0], bool)
    keep[1:] = best[1:] != best[:-1]
    return [int(i) for i in best[keep] if i != blank_id]


def lexicon_beam_search(log_probs: np.ndarray, tokens: tuple[str, ...], blank_id: int, delimiter_id: int,
                        lexicon: frozenset[str], beam: int = 12, prune: float = 12.0,
                        lm: BigramLM | None = None) -> str:
    """CTC prefix beam search where each word must be a lexicon word (spelled along a prefix set).

    A prefix is its collapsed label string; per prefix the log-probability of ending in a blank
    (``pb``) and in its last label (``pnb``), so repeated letters need a blank between them. A
    letter may extend the current word only while the word stays a prefix of a lexicon word; the
    delimiter may end it only when it is a whole lexicon word. With ``lm``, a prefix also carries
    the language-model score of its completed words, which ranks it. Falls back to greedy when no
    path fits.
    """
    prefixes = {w[:i] for w in lexicon for i in range(1, len(w) + 1)}
    delim = tokens[delimiter_id]
    usable = [i for i, t in enumerate(tokens) if i != blank_id and (i == delimiter_id or not t.startswith("<"))]
    # beams: label string -> (pb, pnb); lm_of: label string -> LM score of its completed words
    beams: dict[str, tuple[float, float]] = {"": (0.0, -np.inf)}
    lm_of: dict[str, float] = {"": 0.0}

    def word_score(key: str, word: str) -> float:
        """LM score of ``word``, the last word of ``key`` (which ends with the delimiter)."""
        if lm is None:
            return 0.0
        words = key.rstrip(delim).split(delim)
        prev = words[-2] if len(words) > 1 and words[-2] else "<s>"
        return lm.weight * lm.score(prev, word) + lm.word_bonus

    for frame in log_probs:
        top = frame.max()
        cands = [i for i in usable if frame[i] >= top - prune]
        nxt: dict[str, list[float]] = {}

        def add(key: str, pb: float, pnb: float) -> None:
            cur = nxt.get(key)
            if cur is None:
                nxt[key] = [pb, pnb]
            else:
                cur[0] = np.logaddexp(cur[0], pb)
                cur[1] = np.logaddexp(cur[1], pnb)

        blank = float(frame[blank_id])
        for key, (pb, pnb) in beams.items():
            total = np.logaddexp(pb, pnb)
            add(key, total + blank, -np.inf)
            last = key[-1] if key else ""
            word = key[key.rfind(delim) + 1:]
            for i in cands:
                tok, lp = tokens[i], float(frame[i])
                if tok == last:  # the same label again: collapses unless a blank came between
                    add(key, -np.inf, pnb + lp)
                    extend = pb + lp
                else:
                    extend = total + lp
                if i == delimiter_id:
                    if word not in lexicon:
                        continue
                elif (word + tok) not in prefixes:
                    continue
                if extend > -np.inf:
                    new_key = key + tok
                    if new_key not in lm_of:
                        lm_of[new_key] = lm_of[key] + (word_score(new_key, word) if i == delimiter_id else 0.0)
                    add(new_key, -np.inf, extend)
        ranked = sorted(nxt.items(), key=lambda kv: -(np.logaddexp(*kv[1]) + lm_of[kv[0]]))[:beam]
        beams = {k: (v[0], v[1]) for k, v in ranked}

    def final_score(key: str, pb: float, pnb: float) -> float:
        score = np.logaddexp(pb, pnb) + lm_of[key]
        if lm is not None:
            words = [w for w in key.split(delim) if w]
            if key and not key.endswith(delim):
                score += word_score(key + delim, words[-1])
            score += lm.weight * lm.score(words[-1] if words else "<s>", "</s>")
        return score

    finals = [(final_score(k, *v), k) for k, v in beams.items()
              if k[k.rfind(delim) + 1:] in lexicon or k.endswith(delim) or k == ""]
    if not finals:
        ids = greedy_ids(log_probs, blank_id)
        text = "".join(tokens[i] for i in ids if not tokens[i].startswith("<"))
    else:
        text = max(finals)[1]
    return " ".join(text.replace(delim, " ").split())
