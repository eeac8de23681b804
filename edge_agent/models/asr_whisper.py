"""Whisper-style encoder/decoder recognition, streamed with LocalAgreement-2.

Files (``optimum-cli export onnx``): ``encoder_model.onnx`` (``input_features`` [B, mels, 3000] →
``last_hidden_state``), ``decoder_model.onnx`` (first step: ``input_ids`` + ``encoder_hidden_states``
→ ``logits`` + ``present.{i}.decoder|encoder.key|value``), ``decoder_with_past_model.onnx`` (one
token + ``past_key_values.*`` → ``logits`` + new decoder k/v; the encoder k/v stay those of the
first step).

Decoding: the prompt ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``, then greedy with
the KV cache. A stream may carry context in front of it (``context_ids``: ``<|startofprev|>`` and the
words it expects, Whisper's ``initial_prompt``: a voice turn's tools, the operator's ``[asr]`` words), at
most ``MAX_CONTEXT_TOKENS``; rows of one decode batch share a prompt length, so streams with different
contexts decode in separate batches. Suppressed: the model's ``suppress_tokens``, ``begin_suppress_tokens`` at the first
position, and every special and timestamp token (ids above ``<|endoftext|>``): with
``<|notimestamps|>`` in the prompt a timestamp is never a valid output. ``language="auto"`` picks
the likeliest language token after ``<|startoftranscript|>``.

Streaming: every step re-encodes the utterance so far and re-decodes it forced to start with the
committed tokens; LocalAgreement-2 commits the prefix the last two hypotheses share. A final (and
``transcribe``) encodes the audio padded to 30 s, as Whisper is trained, so a final pass is the one
pass faster-whisper makes. A partial, when the encoder takes a shorter input (``short_context``: the
imported graphs slice their positions, whisper.cpp's ``audio_ctx``), encodes only the audio so far
and 6 s of padding, rounded up to ``partial_context_s``: on two cores a 30 s pass of Whisper base's
encoder costs ~1.3 s, an 8 s one ~0.3 s, which is what lets partials keep up with speech. Rows
of a batch decode in lockstep: each takes its own forced token while it has one, then its own argmax,
so row r of a batch sees exactly what it would see alone. The encoder batches the streams that share
a context length.

On the NPU (static shapes only) ``asr_whisper_npu.NpuWhisperRecognizer`` runs the same decoding with a
30 s encoder and a decoder step over a fixed-size cache, one stream at a time.
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
MAX_CONTEXT_TOKENS = 223  # Whisper's prompt: <|startofprev|> + at most 223 tokens (half the 448 positions)
PARTIAL_PADDING_S = 6.0  # padding after a partial's audio in a short-context pass (context_frames)


class WhisperStream(AudioStream):
    """One utterance's state in Whisper: its audio, what is decoded and committed, its language."""

    def __init__(self, rate: int, language: str | None) -> None:
        super().__init__(rate)
        self.audio = np.zeros(0, np.float32)
        self.decoded_at = 0  # samples covered by the last decode
        self.decoded_full = False  # the last decode was a 30 s pass (a final's, without new audio, reuses it)
        self.agreement = LocalAgreement(2)
        self.language = language  # None until detected (language="auto")
        self.last_ids: list[int] = []
        self.context: list[int] = []  # ``<|startofprev|>`` and the initial prompt's tokens (``context_ids``)
        self.draft: list[int] = []  # a fork's: the tokens its parent's last pass decoded (verified, not trusted)

    def fork(self) -> WhisperStream:
        """A stream with this one's audio so far (pending included) and context, its last tokens as a draft
        the twin's decode verifies in one decoder call: what this stream's final would say if it ended now
        (the service's pause decode). Called while no step of this stream is in flight."""
        twin = WhisperStream(self.rate, self.language)
        with self._lock:
            pending = list(self._pending)
        twin.add_audio(np.concatenate([self.audio, *pending]) if pending else self.audio.copy())
        twin.context, twin.draft = self.context, list(self.last_ids)
        return twin

    def reuses_last(self) -> bool:
        """The final may be the last hypothesis: a 30 s pass over all the audio there is."""
        return self.audio.size == self.decoded_at and bool(self.last_ids) and self.decoded_full


class WhisperRecognizer:
    """Whisper (encoder, decoder with KV cache) re-decoding a growing window, committed by LocalAgreement-2."""

    kind = "whisper"

    def __init__(
        self,
        ref: ModelRef,
        encoder: Session,
        decoder: Session | None,
        decoder_past: Session | None,
        *,
        language: str = "en",
        task: str = "transcribe",
        suppress: bool = True,
        min_step_s: float = 0.5,
        max_tokens_per_s: float = 8.0,
        partial_context_s: float = 1.0,
        final_padding_s: float = 0.0,
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
        self.partial_context_s = partial_context_s  # 0: every partial is a 30 s pass
        # >0 (with short_context): a final (and transcribe) encodes its audio and this much padding, not 30 s
        self.final_padding_s = final_padding_s
        self.short_context = False  # set by open() when the encoder takes shorter inputs
        self._suppress_mask = np.zeros(self.vocab_size, bool)
        self._suppress_mask[[t for t in gen.get("suppress_tokens") or [] if t < self.vocab_size]] = True
        self._suppress_mask[self.eot + 1 :] = True  # specials and timestamps
        self._begin_mask = self._suppress_mask.copy()
        self._begin_mask[[t for t in gen.get("begin_suppress_tokens") or [] if t < self.vocab_size]] = True
        self._prompt_len = 2 + bool(self.lang_to_id) + bool(self.task_to_id)
        self.prev = self.tokenizer.token_to_id("<|startofprev|>")  # None: no context (a tokenizer without it)
        self._context_cache: dict[str, list[int]] = {}

    @classmethod
    def open(
        cls, ref: ModelRef, backend: str = "onnxruntime", options: SessionOptions | None = None, **kwargs
    ) -> WhisperRecognizer:
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k
            in (
                "language",
                "task",
                "suppress",
                "min_step_s",
                "max_tokens_per_s",
                "partial_context_s",
                "final_padding_s",
            )
        }
        files = [ref.path / n for n in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelError(f"{ref.path}: missing {', '.join(missing)} (streaming needs the KV-cache decoder)")
        sessions = [open_session(p, backend, options, warmup=lambda s: None) for p in files]
        engine = cls(ref, *sessions, **kwargs)
        engine.short_context = engine.partial_context_s > 0 and engine.takes_short_context()
        engine.transcribe(np.zeros(engine.sample_rate, np.float32))  # real warm-up
        return engine

    def takes_short_context(self) -> bool:
        """Whether the encoder runs on fewer than 3000 frames and gives one position per two frames:
        true of imported folders (sliced positions); an export that adds the whole 1500-position table
        fails the run (its time axis is fixed in all but name) and keeps 30 s partials."""
        frames = 2 * max(2, round(self.partial_context_s * self.sample_rate / self.features.hop_length / 2))
        dims = next((i.shape for i in self.encoder.inputs if i.name == "input_features"), None)
        if dims is None or len(dims) != 3 or isinstance(dims[2], int):
            return False
        try:
            hidden = self.encode_features(np.zeros((1, self.features.feature_size, frames), np.float32))
        except Exception as exc:  # any runtime's shape error means "no"
            log.info("%s: partials encode 30 s (the encoder takes no shorter input: %s)", self.name, exc)
            return False
        return hidden.shape[1] == frames // 2

    def context_frames(self, samples: int, final: bool) -> int:
        """The encoder input length of a pass over ``samples`` of audio: 30 s for a final (or when the
        encoder takes nothing shorter), else the audio and ``PARTIAL_PADDING_S`` of padding rounded up
        to ``partial_context_s``. Whisper base with little padding loops ("Good morning. Good morning.
        …") or changes the last words; with 6 s its streamed finals on the race corpus matched the
        30 s partials' as often (10 of 12 equal to the one-pass transcript, both ways)."""
        full = self.features.nb_max_frames
        if not self.short_context or (final and self.final_padding_s <= 0):
            return full
        padding = self.final_padding_s if final else PARTIAL_PADDING_S
        step = self.partial_context_s * self.sample_rate
        padded = int(np.ceil((samples + padding * self.sample_rate) / step)) * step
        return min(full, int(np.ceil(padded / self.features.hop_length / 2)) * 2)

    def context_ids(self, text: str) -> list[int]:
        """``<|startofprev|>`` and ``text``'s tokens, its last ``MAX_CONTEXT_TOKENS`` (the words nearest the
        utterance are kept, as Whisper keeps the latest ones), or [] for no text or no such token."""
        text = " ".join(text.split())
        if not text or self.prev is None:
            return []
        cached = self._context_cache.get(text)
        if cached is None:
            ids = self.tokenizer.encode(" " + text, add_special_tokens=False).ids
            cached = [self.prev, *[i for i in ids if i < self.eot][-MAX_CONTEXT_TOKENS:]]
            if len(self._context_cache) > 64:
                self._context_cache.clear()
            self._context_cache[text] = cached
        return cached

    def prompt(self, language: str | None = None, context: Sequence[int] = ()) -> list[int]:
        ids = [*context, self.sot]
        if self.lang_to_id:
            ids.append(self.lang_to_id[language or self.language])
        if self.task_to_id:
            ids.append(self.task_to_id[self.task])
        ids.append(self.no_timestamps)
        return ids

    # -- model calls -------------------------------------------------------------------------

    def encode(self, windows: Sequence[np.ndarray], frames: int | None = None) -> np.ndarray:
        """Encoder states of each window padded to 30 s, of its first ``frames`` mel frames when given."""
        feats = np.stack([log_mel_spectrogram(w, self.features)[:, :frames] for w in windows])
        return self.encode_features(feats)

    def encode_features(self, features: np.ndarray) -> np.ndarray:
        out = self.encoder.run({"input_features": features.astype(np.float32)}, ["last_hidden_state"])
        return out["last_hidden_state"]

    def detect_language(self, hidden: np.ndarray) -> list[str]:
        assert self.decoder is not None  # None only in the NPU's subclass, which has its own
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
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """Greedy, batched in lockstep. Returns per row the generated ids (forced ones included, no EOT).
        ``drafts``: per row, tokens a greedy decode is likely to produce (the last partial's, beyond the
        forced ones): checked in the first decoder call, the longest prefix the model agrees with is kept
        and decoding goes on from there; the result is exactly the greedy decode without a draft."""
        assert self.decoder is not None and self.decoder_past is not None  # see detect_language
        if drafts is not None and any(len(d) > len(f) for d, f in zip(drafts, forced)):
            if hidden.shape[0] > 1:  # rows verify drafts of their own lengths: one at a time
                return [
                    self.decode(hidden[r : r + 1], [prompts[r]], [forced[r]], [max_new[r]], suppress, stop_at_eot, [d])[
                        0
                    ]
                    for r, d in enumerate(drafts)
                ]
            return self._decode_draft(hidden, prompts[0], forced[0], max_new[0], drafts[0], suppress, stop_at_eot)
        rows = list(range(hidden.shape[0]))
        if len({len(p) for p in prompts}) != 1:
            raise InputError("rows of one decode batch need prompts of the same length")
        # The forced tokens every row has go in with the prompt: one decoder call instead of one each.
        common = min(min(len(f) for f in forced), min(max_new) - 1, self.max_positions - len(prompts[0]) - 2)
        common = max(0, common)
        out: list[list[int]] = [[int(t) for t in f[:common]] for f in forced]
        first = [list(p) + o for p, o in zip(prompts, out)]
        res = self.decoder.run({"input_ids": np.asarray(first, np.int64), "encoder_hidden_states": hidden})
        past = {k.replace("present.", "past_key_values.", 1): v for k, v in res.items() if k != "logits"}
        logits = res["logits"][:, -1]
        position = len(first[0])
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

    def _decode_draft(
        self,
        hidden: np.ndarray,
        prompt: Sequence[int],
        forced: Sequence[int],
        max_new: int,
        draft: Sequence[int],
        suppress: bool,
        stop_at_eot: bool,
    ) -> list[list[int]]:
        """One row: the prompt, the forced tokens and the draft in one decoder call; the draft kept up to the
        first token greedy decoding would not choose (or an end of text), the cache cut there, then greedy."""
        assert self.decoder is not None and self.decoder_past is not None
        room = min(max_new, self.max_positions - len(prompt) - 2)
        if list(draft[: len(forced)]) != list(forced):
            draft = forced  # a draft that does not extend the forced tokens is no draft
        draft = [int(t) for t in draft[:room]]
        first = [*prompt, *draft]
        res = self.decoder.run({"input_ids": np.asarray([first], np.int64), "encoder_hidden_states": hidden})
        logits_all = res["logits"][0]
        base = len(prompt)
        keep = min(len(forced), len(draft))
        while keep < len(draft):
            scores = logits_all[base + keep - 1]
            if suppress:
                scores = np.where(self._begin_mask if keep == 0 else self._suppress_mask, -np.inf, scores)
            if int(np.argmax(scores)) != draft[keep]:
                break
            keep += 1
        end = base + keep
        past = {
            k.replace("present.", "past_key_values.", 1): (v[:, :, :end] if ".decoder." in k else v)
            for k, v in res.items()
            if k != "logits"
        }
        out = list(draft[:keep])
        logits = logits_all[end - 1]
        position = end
        while len(out) < max_new and position < self.max_positions:
            t = len(out)
            if t < len(forced):
                token = int(forced[t])
            else:
                scores = logits
                if suppress:
                    scores = np.where(self._begin_mask if t == 0 else self._suppress_mask, -np.inf, scores)
                token = int(np.argmax(scores))
                if stop_at_eot and token == self.eot:
                    break
            out.append(token)
            if len(out) >= max_new or position + 1 >= self.max_positions:
                break
            res = self.decoder_past.run({"input_ids": np.asarray([[token]], np.int64), **past})
            for k, v in res.items():
                if k != "logits":
                    past[k.replace("present.", "past_key_values.", 1)] = v
            logits = res["logits"][0, -1]
            position += 1
        return [out]

    def _budget(self, audio_s: float, forced: int, context: int = 0) -> int:
        """Tokens a decode may produce: a few per second of audio (a random or confused model
        otherwise loops to the 448-position limit), never fewer than the forced prefix + 1."""
        limit = self.max_positions - self._prompt_len - context - 1
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
            elif ended and s.reuses_last():
                todo.append(i)  # nothing new: the last hypothesis becomes final below without a decode
            elif ended or s.audio.size - s.decoded_at >= min_new:
                todo.append(i)
        if not todo:
            return results
        run = [i for i in todo if not (i in ended_at and streams[i].reuses_last())]
        by_context: dict[tuple[int, int], list[int]] = {}
        for i in run:
            key = (self.context_frames(streams[i].audio.size, i in ended_at), len(streams[i].context))
            by_context.setdefault(key, []).append(i)
        for (frames, _), group in by_context.items():
            self._pass([streams[i] for i in group], frames)
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

    def _pass(self, streams: Sequence[WhisperStream], frames: int) -> None:
        """One encoder pass of ``frames`` over the streams' audio and a decode forced by their commits."""
        hidden = self.encode([s.audio for s in streams], frames)
        unknown = [j for j, s in enumerate(streams) if s.language is None]
        if unknown:
            for j, lang in zip(unknown, self.detect_language(hidden[unknown])):
                streams[j].language = lang
        ids = self.decode(
            hidden,
            [self.prompt(s.language, s.context) for s in streams],
            [s.agreement.committed for s in streams],
            [
                self._budget(s.audio.size / self.sample_rate, len(s.agreement.committed), len(s.context))
                for s in streams
            ],
            suppress=self.suppress,
            drafts=[s.draft or s.last_ids for s in streams],
        )
        for s, hyp in zip(streams, ids):
            s.last_ids, s.decoded_at = hyp, s.audio.size
            s.decoded_full = frames == self.context_frames(s.audio.size, True)

    def transcribe(self, samples: np.ndarray, context: str = "") -> Hypothesis:
        """One 30 s pass over ``samples``; ``context``: words to expect (Whisper's initial prompt)."""
        x = np.asarray(samples, np.float32).reshape(-1)[: self.features.n_samples]
        hidden = self.encode([x], self.context_frames(x.size, True))
        lang = self.language if self.language != "auto" else self.detect_language(hidden)[0]
        prev = self.context_ids(context)
        budget = self._budget(x.size / self.sample_rate, 0, len(prev))
        ids = self.decode(hidden, [self.prompt(lang, prev)], [[]], [budget], suppress=self.suppress)[0]
        text = self.text(ids)
        return Hypothesis(text, tuple(ids), True, text, x.size / self.sample_rate)

    def close(self) -> None:
        for s in (self.encoder, self.decoder, self.decoder_past):
            if s is not None:
                s.close()
