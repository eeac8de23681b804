"""Whisper-style encoder/decoder recognition, streamed with LocalAgreement-2.

Files (``optimum-cli export onnx``): ``encoder_model.onnx`` (``input_features`` [B, mels, 3000] →
``last_hidden_state``), ``decoder_model.onnx`` (first step: ``input_ids`` + ``encoder_hidden_states``
→ ``logits`` + ``present.{i}.decoder|encoder.key|value``), ``decoder_with_past_model.onnx`` (one
token + ``past_key_values.*`` → ``logits`` + new decoder k/v; the encoder k/v stay those of the
first step).

Decoding (``whisper_decoding.py``): the prompt ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``,
then greedy with the KV cache; with ``guards`` (the default) a clip the model hears no speech in gives no
text, and neither does a text without a letter or digit ("..."), and a runaway repetition is cut; a final
that only writes out its context is decoded again without it (``echoes``). A stream may carry context
in front of it (``context_ids``: ``<|startofprev|>`` and the words it expects, Whisper's
``initial_prompt``: a voice turn's tools, the operator's ``[asr]`` words), at most
``MAX_CONTEXT_TOKENS``; rows of one decode batch share a prompt length, so streams with different contexts
decode in separate batches. Suppressed: the model's ``suppress_tokens``, ``begin_suppress_tokens`` at the
first position, and every special and timestamp token (ids above ``<|endoftext|>``): with
``<|notimestamps|>`` in the prompt a timestamp is never a valid output. ``language="auto"`` picks the
likeliest language token after ``<|startoftranscript|>``.

Streaming: every step re-encodes the utterance so far; a partial re-decodes it forced to start with the
committed tokens, and LocalAgreement-2 commits the prefix the last two hypotheses share (commits only grow
while the utterance lasts). A final decodes freely, as one pass over the same window does (``transcribe``):
the committed tokens are only its draft, so a word a partial committed wrong is heard again, and the
final's text is exactly the one pass's. The draft (the last pass's tokens) goes into the decoder's first
call with the prompt and is kept as far as greedy decoding agrees with it: a right draft costs one decoder
call instead of one per token. A final with no audio since the last pass over the final's window decodes
on that pass's encoder states (kept per stream), or, when that pass forced nothing, is its text outright.

A final (and ``transcribe``) encodes the audio padded to 30 s, as Whisper is trained, so a final pass is the
one pass faster-whisper makes; with ``final_padding_s`` > 0 and an encoder that takes a shorter input
(``short_context``: the imported graphs slice their positions, whisper.cpp's ``audio_ctx``) the audio and
that much padding. A partial there encodes only the audio so far and the same padding (6 s when finals
take 30 s), rounded up to ``partial_context_s``: on two cores a 30 s pass of Whisper base's encoder costs
~1.3 s, an 8 s one ~0.3 s, which is what lets partials keep up with speech. Rows of a batch decode in
lockstep: each takes its own forced token while it has one, then its own argmax, so row r of a batch sees
exactly what it would see alone. The encoder batches the streams that share a context length.

On the NPU (static shapes only) ``asr_whisper_npu.NpuWhisperRecognizer`` runs the same decoding with a
30 s encoder and a decoder step over a fixed-size cache, one stream at a time.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Sequence

import numpy as np

from ..backends import Session, SessionOptions, open_session, optional_inputs
from ..errors import InputError, ModelError
from ..graphs.builder import LOGITS_TO_KEEP
from .agreement import LocalAgreement
from .catalog import ModelRef
from .recognizer import AudioStream, Hypothesis, read_json
from .whisper_decoding import WhisperDecoding
from .whisper_features import WhisperFeatureConfig, log_mel_spectrogram

log = logging.getLogger(__name__)
MAX_CONTEXT_TOKENS = 223  # Whisper's prompt: <|startofprev|> + at most 223 tokens (half the 448 positions)
PARTIAL_PADDING_S = 6.0  # padding after a partial's audio in a short-context pass without final_padding_s


class WhisperStream(AudioStream):
    """One utterance's state in Whisper: its audio, what is decoded and committed, its language."""

    def __init__(self, rate: int, language: str | None) -> None:
        super().__init__(rate)
        self.audio = np.zeros(0, np.float32)
        self.decoded_at = 0  # samples covered by the last decode
        self.agreement = LocalAgreement(2)
        self.language = language  # None until detected (language="auto")
        self.last_ids: list[int] = []
        self.unforced = False  # the last decode forced nothing: ``last_ids`` is a one pass's over its window
        self.context: list[int] = []  # ``<|startofprev|>`` and the initial prompt's tokens (``context_ids``)
        self.draft: list[int] = []  # a fork's: the tokens its parent's last pass decoded (verified, not trusted)
        # the encoder states of the last pass when its window was the final's, their frames and the samples
        # they cover: a final with no audio since decodes on them without an encoder pass
        self.hidden: np.ndarray | None = None
        self.hidden_frames = self.hidden_at = 0

    def fork(self) -> WhisperStream:
        """A stream with this one's audio so far (pending included) and context, its last tokens as a draft
        the twin's decode verifies in one decoder call: what this stream's final would say if it ended now
        (the service's pause decode). With nothing pending since a pass over the final's window the twin
        also takes that pass's encoder states (read only). Called while no step of this stream is in flight."""
        twin = WhisperStream(self.rate, self.language)
        with self._lock:
            pending = list(self._pending)
        twin.add_audio(np.concatenate([self.audio, *pending]) if pending else self.audio.copy())
        twin.context, twin.draft = self.context, list(self.last_ids)
        if not pending and self.hidden is not None and self.hidden_at == self.audio.size:
            twin.hidden, twin.hidden_frames, twin.hidden_at = self.hidden, self.hidden_frames, self.hidden_at
            twin.last_ids, twin.unforced = list(self.last_ids), self.unforced
        return twin

    def states_for(self, frames: int) -> np.ndarray | None:
        """The kept encoder states when they are those of a ``frames`` pass over all the audio there is."""
        if self.hidden is not None and self.hidden_frames == frames and self.hidden_at == self.audio.size:
            return self.hidden
        return None


class WhisperRecognizer(WhisperDecoding):
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
        guards: bool = True,
    ) -> None:
        from tokenizers import Tokenizer

        self.ref, self.name = ref, ref.name
        self.encoder, self.decoder, self.decoder_past = encoder, decoder, decoder_past
        self.keeps_logits = (_keeps_logits(decoder), _keeps_logits(decoder_past))
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
        self.guards = guards  # nothing heard, runaway repetitions cut (whisper_decoding); False: plain greedy
        self.short_context = False  # set by open() when the encoder takes shorter inputs
        self._suppress_mask = np.zeros(self.vocab_size, bool)
        self._suppress_mask[[t for t in gen.get("suppress_tokens") or [] if t < self.vocab_size]] = True
        self._suppress_mask[self.eot + 1 :] = True  # specials and timestamps
        self._begin_mask = self._suppress_mask.copy()
        self._begin_mask[[t for t in gen.get("begin_suppress_tokens") or [] if t < self.vocab_size]] = True
        self._prompt_len = 2 + bool(self.lang_to_id) + bool(self.task_to_id)
        self.prev = self.tokenizer.token_to_id("<|startofprev|>")  # None: no context (a tokenizer without it)
        nocaptions = self.tokenizer.token_to_id("<|nocaptions|>")
        self.no_speech_id = nocaptions if nocaptions is not None else self.tokenizer.token_to_id("<|nospeech|>")
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
                "guards",
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
        """The encoder input length of a pass over ``samples`` of audio: 30 s for a final without
        ``final_padding_s`` (or when the encoder takes nothing shorter), else the audio and that padding
        (a partial's: ``final_padding_s``, or ``PARTIAL_PADDING_S`` without one) rounded up to
        ``partial_context_s``: partials and finals share their window, so a final with no audio since the
        last partial is that partial's pass. Whisper base with little padding loops ("Good morning. Good
        morning. …") or changes the last words; with 6 s its streamed finals on the race corpus matched the
        30 s partials' as often (10 of 12 equal to the one-pass transcript, both ways)."""
        full = self.features.nb_max_frames
        if not self.short_context or (final and self.final_padding_s <= 0):
            return full
        padding = self.final_padding_s if self.final_padding_s > 0 else PARTIAL_PADDING_S
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
        min_new = int(self.min_step_s * self.sample_rate)
        # ended when its audio was taken: end() during this step may follow audio this step never took
        finals: list[int] = []
        partials: list[int] = []
        for i, s in enumerate(streams):
            new, ended = s.take()
            if new.size:
                s.audio = np.concatenate([s.audio, new])[: self.features.n_samples]
            if s.finished:
                continue
            if ended and s.audio.size == 0:
                s.finished = True
                results[i] = Hypothesis("", (), True, "", 0.0)
            elif ended:
                finals.append(i)
            elif s.audio.size - s.decoded_at >= min_new:
                partials.append(i)
        ended_at = set(finals)
        groups: dict[tuple[int, int], list[int]] = {}
        for i in [*(i for i in finals if not self._settled(streams[i])), *partials]:
            key = (self.context_frames(streams[i].audio.size, i in ended_at), len(streams[i].context))
            groups.setdefault(key, []).append(i)
        for (frames, _), group in groups.items():
            self._pass([streams[i] for i in group], frames, [i in ended_at for i in group])
        for i in [*finals, *partials]:
            results[i] = self._hypothesis(streams[i], i in ended_at)
        return results

    def _settled(self, s: WhisperStream) -> bool:
        """The stream's last pass is what its final would be: unforced, over the final's window of all its
        audio (its language fixed: ``auto`` detects a final's language on the final's own window)."""
        frames = self.context_frames(s.audio.size, True)
        return s.unforced and self.language != "auto" and s.states_for(frames) is not None

    def _hypothesis(self, s: WhisperStream, final: bool) -> Hypothesis:
        if final:
            s.agreement.finish(s.last_ids)
            s.finished = True
        else:
            s.agreement.insert(s.last_ids)
        stable = self.text(s.agreement.committed)
        return Hypothesis(self.text(s.last_ids), tuple(s.last_ids), final, stable, s.audio.size / self.sample_rate)

    def _pass(self, streams: Sequence[WhisperStream], frames: int, final: Sequence[bool]) -> None:
        """One encoder pass of ``frames`` over the streams' audio (a final's kept states stand in for its own
        pass) and one decode: a partial forced to start with its commits, a final free (what one pass over its
        window gives), each with its last tokens as a draft the decoder verifies in its first call."""
        kept = [s.states_for(frames) if f else None for s, f in zip(streams, final)]
        fresh = [j for j, h in enumerate(kept) if h is None]
        if len(fresh) == len(streams):
            hidden = self.encode([s.audio for s in streams], frames)
        else:
            if fresh:
                encoded = self.encode([streams[j].audio for j in fresh], frames)
                for k, j in enumerate(fresh):
                    kept[j] = encoded[k : k + 1]
            hidden = np.concatenate([h for h in kept if h is not None])
        # a final detects its language on its own window, as the one pass does
        detect = [j for j, s in enumerate(streams) if s.language is None or (final[j] and self.language == "auto")]
        if detect:
            for j, lang in zip(detect, self.detect_language(hidden[detect])):
                streams[j].language = lang
        forced = [[] if f else s.agreement.committed for s, f in zip(streams, final)]
        ids = self.decode(
            hidden,
            [self.prompt(s.language, s.context) for s in streams],
            forced,
            [self._budget(s.audio.size / self.sample_rate, len(f), len(s.context)) for s, f in zip(streams, forced)],
            suppress=self.suppress,
            drafts=[s.draft or s.last_ids for s in streams],
            guard=self.guards,
        )
        ids = self._unechoed(
            hidden,
            ids,
            [s.context if f else () for s, f in zip(streams, final)],
            [s.language for s in streams],
            [s.audio.size for s in streams],
        )
        for j, (s, hyp) in enumerate(zip(streams, ids)):
            s.last_ids, s.decoded_at, s.unforced = self._heard(hyp), s.audio.size, not forced[j]
            s.hidden = None
            if not final[j] and frames == self.context_frames(s.audio.size, True):
                s.hidden, s.hidden_frames, s.hidden_at = hidden[j : j + 1].copy(), frames, s.audio.size

    def transcribe(self, samples: np.ndarray, context: str = "") -> Hypothesis:
        """One pass over ``samples`` in a final's window (30 s, or the audio and ``final_padding_s``);
        ``context``: words to expect (Whisper's initial prompt). A streamed final is this pass's text."""
        x = np.asarray(samples, np.float32).reshape(-1)[: self.features.n_samples]
        hidden = self.encode([x], self.context_frames(x.size, True))
        lang = self.language if self.language != "auto" else self.detect_language(hidden)[0]
        prev = self.context_ids(context)
        budget = self._budget(x.size / self.sample_rate, 0, len(prev))
        prompt = self.prompt(lang, prev)
        decoded = self.decode(hidden, [prompt], [[]], [budget], suppress=self.suppress, guard=self.guards)
        ids = self._heard(self._unechoed(hidden, decoded, [prev], [lang], [x.size])[0])
        text = self.text(ids)
        return Hypothesis(text, tuple(ids), True, text, x.size / self.sample_rate)

    def _sessions(self) -> list[Session]:
        return [s for s in (self.encoder, self.decoder, self.decoder_past) if s is not None]

    @property
    def interruptible(self) -> bool:
        """Whether ``interrupt`` can stop a step: its sessions can (ONNX Runtime's)."""
        return all(hasattr(s, "interrupt") for s in self._sessions())

    def interrupt(self) -> None:
        """Stop the step in progress (any thread): it raises ``Interrupted``, as does every later model call
        until ``resume``. Its streams keep their audio and are as before its decode (every step decodes a
        stream from its audio), so a later step loses nothing."""
        for s in self._sessions():
            if hasattr(s, "interrupt"):
                s.interrupt()

    def resume(self) -> None:
        for s in self._sessions():
            if hasattr(s, "resume"):
                s.resume()

    def _unechoed(
        self,
        hidden: np.ndarray,
        ids: list[list[int]],
        contexts: Sequence[Sequence[int]],
        languages: Sequence[str | None],
        samples: Sequence[int],
    ) -> list[list[int]]:
        """``ids``, where a row's text is only words of its context (``contexts``: a final's, () for rows not
        checked; Whisper, unsure of the audio, may write out its prompt: "Set the room's thermostat in degrees
        Celsius." for "sing me a song") decoded again without the context, with the guards on."""
        if not self.guards:
            return ids
        echoed = [j for j, c in enumerate(contexts) if c and echoes(self.text(ids[j]), self.text(c))]
        if not echoed:
            return ids
        again = self.decode(
            hidden[echoed],
            [self.prompt(languages[j]) for j in echoed],
            [[] for _ in echoed],
            [self._budget(samples[j] / self.sample_rate, 0) for j in echoed],
            suppress=self.suppress,
            guard=self.guards,
        )
        out = list(ids)
        for j, hyp in zip(echoed, again):
            log.debug(
                "the recogniser wrote out its context (%r): heard again without it: %r",
                self.text(ids[j]),
                self.text(hyp),
            )
            out[j] = hyp
        return out

    def _heard(self, ids: list[int]) -> list[int]:
        """``ids``, or none when their text has no letter or digit ("...": what Whisper says over a chord or a
        hum it did not judge silent), with the guards on."""
        return ids if not self.guards or any(c.isalnum() for c in self.text(ids)) else []

    def close(self) -> None:
        for s in self._sessions():
            s.close()


def echoes(text: str, context: str, min_words: int = 4, likeness: float = 0.8) -> bool:
    """Whether ``text`` is a run of ``context``'s words (case and punctuation aside), at least ``min_words``
    of them, a word or so changed (``difflib``'s ratio >= ``likeness`` against a run of about its length):
    the recogniser wrote out its prompt rather than what it heard."""
    said, prompt = _word_list(text), _word_list(context)
    n = len(said)
    if n < min_words:
        return False
    match = difflib.SequenceMatcher(None, said, autojunk=False)
    for width in (n, n - 1, n + 1):
        for k in range(max(1, len(prompt) - width + 1)):
            match.set_seq2(prompt[k : k + width])
            if match.ratio() >= likeness:
                return True
    return False


def _word_list(text: str) -> list[str]:
    return re.findall(r"[^\W_]+(?:'[^\W_]+)?", text.lower())


def _keeps_logits(session: Session | None) -> bool:
    """Whether a decoder can leave out the logits of positions nobody reads (the context's): an optional
    ``logits_to_keep`` input, which the graphs the agent builds have."""
    return session is not None and LOGITS_TO_KEEP in optional_inputs(session)
