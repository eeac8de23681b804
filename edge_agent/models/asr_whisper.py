"""Whisper-style encoder/decoder recognition, streamed with LocalAgreement-2.

Files (``optimum-cli export onnx``): ``encoder_model.onnx`` (``input_features`` [B, mels, 3000] →
``last_hidden_state``), ``decoder_model.onnx`` (first step: ``input_ids`` + ``encoder_hidden_states``
→ ``logits`` + ``present.{i}.decoder|encoder.key|value``), ``decoder_with_past_model.onnx`` (one
token + ``past_key_values.*`` → ``logits`` + new decoder k/v; the encoder k/v stay those of the
first step).

Decoding: the prompt ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``, then greedy with
the KV cache. Suppressed: the model's ``suppress_tokens``, ``begin_suppress_tokens`` at the first
position, and every special and timestamp token (ids above ``<|endoftext|>``): with
``<|notimestamps|>`` in the prompt a timestamp is never a valid output. ``language="auto"`` picks
the likeliest language token after ``<|startoftranscript|>``.

Streaming: every step re-encodes the utterance so far (padded to 30 s, as Whisper is trained) and
re-decodes it forced to start with the committed tokens; LocalAgreement-2 commits the prefix the
last two hypotheses share. Rows of a batch decode in lockstep: each takes its own forced token
while it has one, then its own argmax, so row r of a batch sees exactly what it would see alone.
The encoder batches any streams (its input is always 30 s).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..backends import Session, SessionOptions, open_session
from ..errors import InputError, ModelError
from .agreement import LocalAgreement
from .catalog import ModelRef
from .recognizer import AudioStream, Hypothesis, read_json
from .whisper_features import WhisperFeatureConfig, log_mel_spectrogram

log = logging.getLogger(__name__)


class WhisperStream(AudioStream):
    """One utterance's state in Whisper: its audio, what is decoded and committed, its language."""

    def __init__(self, rate: int, language: str | None) -> None:
        super().__init__(rate)
        self.audio = np.zeros(0, np.float32)
        self.decoded_at = 0  # samples covered by the last decode
        self.agreement = LocalAgreement(2)
        self.language = language  # None until detected (language="auto")
        self.last_ids: list[int] = []


class WhisperRecognizer:
    """Whisper (encoder, decoder with KV cache) re-decoding a growing window, committed by LocalAgreement-2."""

    kind = "whisper"

    def __init__(
        self,
        ref: ModelRef,
        encoder: Session,
        decoder: Session,
        decoder_past: Session,
        *,
        language: str = "en",
        task: str = "transcribe",
        suppress: bool = True,
        min_step_s: float = 0.5,
        max_tokens_per_s: float = 8.0,
    ) -> None:
        from tokenizers import Tokenizer

        self.ref, self.name = ref, ref.name
        self.encoder, self.decoder, self.decoder_past = encoder, decoder, decoder_past
        self.tokenizer = Tokenizer.from_file(str(ref.path / "tokenizer.json"))
        self.features = WhisperFeatureConfig.from_folder(ref.path)
        self.sample_rate = self.features.sampling_rate
        self.max_utterance_s = self.features.n_samples / self.sample_rate
        gen = read_json(ref.path / "generation_config.json")
        cfg = ref.config
        self.sot = int(gen.get("decoder_start_token_id", cfg.get("decoder_start_token_id", 50258)))
        self.eot = int(gen.get("eos_token_id", cfg.get("eos_token_id", 50257)))
        self.no_timestamps = int(gen.get("no_timestamps_token_id", self.eot + 106))
        self.lang_to_id = {k.strip("<|>"): int(v) for k, v in (gen.get("lang_to_id") or {}).items()}
        self.task_to_id = {k: int(v) for k, v in (gen.get("task_to_id") or {}).items()}
        self.vocab_size = int(cfg.get("vocab_size", self.tokenizer.get_vocab_size()))
        self.max_positions = int(cfg.get("max_target_positions", 448))
        if language != "auto" and self.lang_to_id and language not in self.lang_to_id:
            raise InputError(f"{ref.name} has no language {language!r}; it knows {sorted(self.lang_to_id)} or 'auto'")
        if self.task_to_id and task not in self.task_to_id:
            raise InputError(f"{ref.name} has no task {task!r}; choose one of {sorted(self.task_to_id)}")
        self.language, self.task = language, task
        self.suppress, self.min_step_s, self.max_tokens_per_s = suppress, min_step_s, max_tokens_per_s
        self._suppress_mask = np.zeros(self.vocab_size, bool)
        self._suppress_mask[[t for t in gen.get("suppress_tokens") or [] if t < self.vocab_size]] = True
        self._suppress_mask[self.eot + 1 :] = True  # specials and timestamps
        self._begin_mask = self._suppress_mask.copy()
        self._begin_mask[[t for t in gen.get("begin_suppress_tokens") or [] if t < self.vocab_size]] = True
        self._prompt_len = 2 + bool(self.lang_to_id) + bool(self.task_to_id)

    @classmethod
    def open(
        cls, ref: ModelRef, backend: str = "onnxruntime", options: SessionOptions | None = None, **kwargs
    ) -> WhisperRecognizer:
        kwargs = {
            k: v for k, v in kwargs.items() if k in ("language", "task", "suppress", "min_step_s", "max_tokens_per_s")
        }
        files = [ref.path / n for n in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelError(f"{ref.path}: missing {', '.join(missing)} (streaming needs the KV-cache decoder)")
        sessions = [open_session(p, backend, options, warmup=lambda s: None) for p in files]
        engine = cls(ref, *sessions, **kwargs)
        engine.transcribe(np.zeros(engine.sample_rate, np.float32))  # real warm-up
        return engine

    def prompt(self, language: str | None = None) -> list[int]:
        ids = [self.sot]
        if self.lang_to_id:
            ids.append(self.lang_to_id[language or self.language])
        if self.task_to_id:
            ids.append(self.task_to_id[self.task])
        ids.append(self.no_timestamps)
        return ids

    # -- model calls -------------------------------------------------------------------------

    def encode(self, windows: Sequence[np.ndarray]) -> np.ndarray:
        feats = np.stack([log_mel_spectrogram(w, self.features) for w in windows])
        return self.encode_features(feats)

    def encode_features(self, features: np.ndarray) -> np.ndarray:
        out = self.encoder.run({"input_features": features.astype(np.float32)}, ["last_hidden_state"])
        return out["last_hidden_state"]

    def detect_language(self, hidden: np.ndarray) -> list[str]:
        logits = self.decoder.run(
            {"input_ids": np.full((hidden.shape[0], 1), self.sot, np.int64), "encoder_hidden_states": hidden},
            ["logits"],
        )["logits"][:, -1]
        names, ids = list(self.lang_to_id), np.array(list(self.lang_to_id.values()))
        return [names[int(np.argmax(row[ids]))] for row in logits]

    def decode(
        self,
        hidden: np.ndarray,
        prompts: Sequence[Sequence[int]],
        forced: Sequence[Sequence[int]],
        max_new: Sequence[int],
        suppress: bool = True,
        stop_at_eot: bool = True,
    ) -> list[list[int]]:
        """Greedy, batched in lockstep. Returns per row the generated ids (forced ones included, no EOT)."""
        rows = list(range(hidden.shape[0]))
        if len({len(p) for p in prompts}) != 1:
            raise InputError("rows of one decode batch need prompts of the same length")
        out: list[list[int]] = [[] for _ in rows]
        res = self.decoder.run({"input_ids": np.asarray(prompts, np.int64), "encoder_hidden_states": hidden})
        past = {k.replace("present.", "past_key_values.", 1): v for k, v in res.items() if k != "logits"}
        logits = res["logits"][:, -1]
        position = len(prompts[0])
        while rows:
            tokens, keep = [], []
            for j, r in enumerate(rows):
                t = len(out[r])
                if t < len(forced[r]):
                    token = int(forced[r][t])
                else:
                    scores = logits[j]
                    if suppress:
                        scores = np.where(self._begin_mask if t == 0 else self._suppress_mask, -np.inf, scores)
                    token = int(np.argmax(scores))
                    if stop_at_eot and token == self.eot:
                        continue
                out[r].append(token)
                if len(out[r]) < max_new[r] and position + 1 < self.max_positions:
                    keep.append(j)
                    tokens.append(token)
            if not keep:
                break
            if len(keep) < len(rows):  # finished rows leave the batch: slice every cache on the batch axis
                idx = np.asarray(keep)
                past = {k: v[idx] for k, v in past.items()}
            rows = [rows[j] for j in keep]
            res = self.decoder_past.run({"input_ids": np.asarray(tokens, np.int64)[:, None], **past})
            for k, v in res.items():
                if k != "logits":
                    past[k.replace("present.", "past_key_values.", 1)] = v
            logits = res["logits"][:, -1]
            position += 1
        return out

    def _budget(self, audio_s: float, forced: int) -> int:
        """Tokens a decode may produce: a few per second of audio (a random or confused model
        otherwise loops to the 448-position limit), never fewer than the forced prefix + 1."""
        limit = self.max_positions - self._prompt_len - 1
        return min(limit, max(forced + 1, int(4 + self.max_tokens_per_s * audio_s)))

    # -- streaming ---------------------------------------------------------------------------

    def new_stream(self) -> WhisperStream:
        return WhisperStream(self.sample_rate, None if self.language == "auto" else self.language)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.eot], skip_special_tokens=True).strip()

    def step(self, streams: Sequence[WhisperStream]) -> list[Hypothesis | None]:
        results: list[Hypothesis | None] = [None] * len(streams)
        todo = []
        min_new = int(self.min_step_s * self.sample_rate)
        # ended when its audio was taken: end() during this step may follow audio this step never took
        ended_at: set[int] = set()
        for i, s in enumerate(streams):
            new, ended = s.take()
            if ended:
                ended_at.add(i)
            if new.size:
                s.audio = np.concatenate([s.audio, new])[: self.features.n_samples]
            if s.finished:
                continue
            if ended and s.audio.size == 0:
                s.finished = True
                results[i] = Hypothesis("", (), True, "", 0.0)
            elif ended and s.audio.size == s.decoded_at and s.last_ids:
                todo.append(i)  # nothing new: the last hypothesis becomes final below without a decode
            elif ended or s.audio.size - s.decoded_at >= min_new:
                todo.append(i)
        if not todo:
            return results
        run = [
            i
            for i in todo
            if not (i in ended_at and streams[i].audio.size == streams[i].decoded_at and streams[i].last_ids)
        ]
        if run:
            hidden = self.encode([streams[i].audio for i in run])
            unknown = [j for j, i in enumerate(run) if streams[i].language is None]
            if unknown:
                for j, lang in zip(unknown, self.detect_language(hidden[unknown])):
                    streams[run[j]].language = lang
            ids = self.decode(
                hidden,
                [self.prompt(streams[i].language) for i in run],
                [streams[i].agreement.committed for i in run],
                [
                    self._budget(streams[i].audio.size / self.sample_rate, len(streams[i].agreement.committed))
                    for i in run
                ],
                suppress=self.suppress,
            )
            for i, hyp in zip(run, ids):
                streams[i].last_ids, streams[i].decoded_at = hyp, streams[i].audio.size
        for i in todo:
            s = streams[i]
            if i in ended_at:
                s.agreement.finish(s.last_ids)
                s.finished = True
            else:
                s.agreement.insert(s.last_ids)
            stable = self.text(s.agreement.committed)
            results[i] = Hypothesis(
                self.text(s.last_ids), tuple(s.last_ids), s.finished, stable, s.audio.size / self.sample_rate
            )
        return results

    def transcribe(self, samples: np.ndarray) -> Hypothesis:
        x = np.asarray(samples, np.float32).reshape(-1)[: self.features.n_samples]
        hidden = self.encode([x])
        lang = self.language if self.language != "auto" else self.detect_language(hidden)[0]
        ids = self.decode(
            hidden, [self.prompt(lang)], [[]], [self._budget(x.size / self.sample_rate, 0)], suppress=self.suppress
        )[0]
        text = self.text(ids)
        return Hypothesis(text, tuple(ids), True, text, x.size / self.sample_rate)

    def close(self) -> None:
        for s in (self.encoder, self.decoder, self.decoder_past):
            s.close()
