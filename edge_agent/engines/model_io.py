"""Model-side inputs for calibration and the accuracy gate: what to feed, what to read back.

- LLM (decoder export with KV cache): a prompt is tokenized (chat template for ``messages``), cut
  to ``max_tokens``, and run as one prefill with an empty past; the logits of every position are a
  teacher-forced next-token prediction, i.e. one decode step each. An engine that gives the last
  position's logits only (``backends.last_position_only``: TensorRT engines of imported decoders)
  prefills the first half of the prompt and decodes the rest one token a call, teacher-forced: the
  logits of the positions from the prefill's last on (the gate compares those with FP32's).
- ASR (streaming CTC, ``demo-asr``): an utterance is streamed in the model's own chunks with its
  GRU state carried, exactly as served; calibration records the real chunk inputs (features and
  states), and the gate decodes text greedily and scores WER.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends import Session, SessionOptions, is_stateful, last_position_only, open_session
from ..errors import InputError, ModelError
from ..models.catalog import ModelRef
from .datasets import AudioSample, TextSample

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Timed:
    """A probe run's outputs per sample, with each sample's latency."""

    outputs: list[np.ndarray]
    latency_ms: list[float]  # one per sample

    @property
    def median_ms(self) -> float:
        return float(np.median(self.latency_ms)) if self.latency_ms else 0.0


class LlmProbe:
    """Feeds an LLM's held-out prompts as one teacher-forced prefill each and reads the logits back."""

    def __init__(self, ref: ModelRef, max_tokens: int = 64) -> None:
        from ..models.tokenizer import Message, Tokenizer

        if ref.kind != "llm":
            raise ModelError(f"{ref.name} is a {ref.kind} model, not an LLM (recipe workload = 'llm')")
        self.ref = ref
        self.max_tokens = max_tokens
        self._tok = Tokenizer(ref.path, ref.model_type)
        self._message = Message

    def token_ids(self, sample: TextSample) -> list[int]:
        if sample.messages is not None:
            msgs = [self._message(role, content) for role, content in sample.messages]
            ids = self._tok.encode_chat(msgs)
        else:
            ids = self._tok.encode(sample.prompt or "")
        if not ids:
            raise InputError(f"line {sample.line}: the prompt tokenizes to nothing")
        return list(ids)[: self.max_tokens]

    def feeds(self, session: Session, ids: Sequence[int]) -> dict[str, np.ndarray]:
        n = len(ids)
        feeds: dict[str, np.ndarray] = {}
        for spec in session.inputs:
            if spec.name == "input_ids":
                feeds[spec.name] = np.asarray([ids], dtype=spec.dtype)
            elif spec.name == "attention_mask":
                feeds[spec.name] = np.ones((1, n), dtype=spec.dtype)
            elif spec.name == "position_ids":
                feeds[spec.name] = np.arange(n, dtype=spec.dtype)[None]
            elif _PAST.match(spec.name):
                heads, head_dim = self._kv_dims(spec.shape)
                feeds[spec.name] = np.zeros((1, heads, 0, head_dim), dtype=spec.dtype)
            else:
                raise ModelError(
                    f"{self.ref.name}: unexpected LLM input {spec.name!r} (not a standard KV-cache export)"
                )
        return feeds

    def _kv_dims(self, shape: tuple) -> tuple[int, int]:
        heads, head_dim = shape[1], shape[3]
        cfg = self.ref.config
        if not isinstance(heads, int):
            heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        if not isinstance(head_dim, int):
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        return heads, head_dim

    def calibration_feeds(self, session: Session, samples: Sequence[TextSample]) -> list[dict[str, np.ndarray]]:
        return [self.feeds(session, self.token_ids(s)) for s in samples]

    def run(
        self,
        session: Session,
        samples: Sequence[TextSample],
        progress: Progress | None = None,
        every_position: bool = True,
    ) -> Timed:
        """Logits ``[positions, vocab]`` per sample, with the latency of each prefill (of each sample's
        steps, for a stateful model). ``every_position=False`` (speed): a last-position engine runs the
        prefill alone, and its one row comes back."""
        outs, lat = [], []
        stateful = is_stateful(session)
        last_only = last_position_only(session) and every_position
        for i, s in enumerate(samples):
            ids = self.token_ids(s)
            t0 = time.perf_counter()
            if stateful:
                logits = self._stepped(session, ids)
            elif last_only:
                logits = self._prefill_then_steps(session, ids)
            else:
                logits = session.run(self.feeds(session, ids), ["logits"])["logits"]
            lat.append((time.perf_counter() - t0) * 1e3)
            outs.append(np.asarray(logits[0], dtype=np.float32))
            if progress:
                progress(i + 1, len(samples))
        return Timed(outs, lat)

    def _prefill_then_steps(self, session: Session, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits ``[1, n - h + 1, vocab]`` of an engine that keeps the last position only: a
        prefill of the first ``h = max(n // 2, 1)`` tokens (its last position's logits), then one token a
        call with the KV cache carried, so both the prefill and the decode profile are scored."""
        dtypes = {s.name: s.dtype for s in session.inputs}
        head = max(len(ids) // 2, 1)
        feeds = self.feeds(session, ids[:head])
        out = session.run(feeds)
        rows = [out["logits"][0, -1]]
        for n in range(head + 1, len(ids) + 1):
            feeds.update(
                {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if k.startswith("present.")}
            )
            feeds["input_ids"] = np.asarray([ids[n - 1 : n]], dtype=dtypes["input_ids"])
            if "attention_mask" in feeds:
                feeds["attention_mask"] = np.ones((1, n), dtype=dtypes["attention_mask"])
            if "position_ids" in feeds:
                feeds["position_ids"] = np.asarray([[n - 1]], dtype=dtypes["position_ids"])
            out = session.run(feeds)
            rows.append(out["logits"][0, -1])
        return np.stack(rows)[None]

    @staticmethod
    def _stepped(session: Session, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits ``[1, positions - 1, vocab]`` of a stateful model (the NPU's LLM mode),
        which returns the last position's only: a two-token prefill, then one token a step. The plugin
        takes a one-token run for a generate step, so a sequence starts with two tokens and the first
        position has no logits here (the gate compares from the second)."""
        session.reset_state()  # type: ignore[attr-defined]  # a stateful session
        rows = []
        for n in range(2, len(ids) + 1):
            start = 0 if n == 2 else n - 1
            feeds: dict[str, np.ndarray] = {
                "input_ids": np.asarray([ids[start:n]], dtype=np.int64),
                "attention_mask": np.ones((1, n), dtype=np.int64),
                "position_ids": np.arange(start, n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
            rows.append(session.run(feeds, ["logits"])["logits"][0, -1])
        if not rows:  # a one-token sample: no position to compare
            width = next((s.shape[-1] for s in session.outputs if s.name == "logits"), 0)
            return np.zeros((1, 0, width if isinstance(width, int) else 0), np.float32)
        return np.stack(rows)[None]


class _Recorder:
    """A Session wrapper that keeps copies of every feed: the real chunk inputs of a streamed utterance."""

    def __init__(self, inner: Session) -> None:
        self.inner, self.backend = inner, inner.backend
        self.inputs, self.outputs = inner.inputs, inner.outputs
        self.feeds: list[dict[str, np.ndarray]] = []

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self.inner.run(feeds, output_names)

    def close(self) -> None:
        self.inner.close()


class AsrProbe:
    """Streams a streaming-CTC model's utterances in its own chunks, state carried, as it is served."""

    def __init__(self, ref: ModelRef) -> None:
        if ref.model_type != "streaming-ctc":
            raise ModelError(
                f"{ref.name}: the ASR build path takes streaming CTC models (model_type "
                f"'streaming-ctc', like demo-asr); this one is {ref.model_type!r}"
            )
        self.ref = ref

    def runner(self, graph: Path, backend: str = "onnxruntime", options: SessionOptions | None = None):
        """A streaming runner whose session is ``graph`` (a quantized/compiled copy of the model)."""
        from ..models.asr_streaming_ctc import StreamingCtcRunner

        runner = StreamingCtcRunner(self.ref.path, "onnxruntime", SessionOptions(threads=1))
        if Path(graph) != self.ref.path / "model.onnx" or backend != "onnxruntime" or options is not None:
            runner.session.close()
            runner.session = open_session(graph, backend, options or SessionOptions(threads=1), warmup=runner._warmup)
        return runner

    def _audio(self, sample: AudioSample, rate: int) -> np.ndarray:
        from ..audio.wav import read_audio

        try:
            samples, _ = read_audio(sample.audio, rate)
        except InputError as exc:
            raise InputError(f"line {sample.line}: {exc}") from None
        return samples

    def calibration_feeds(self, samples: Sequence[AudioSample], progress: Progress | None = None) -> list[dict]:
        runner = self.runner(self.ref.path / "model.onnx")
        recorder = _Recorder(runner.session)
        runner.session = recorder
        try:
            for i, s in enumerate(samples):
                runner.stream(self._audio(s, runner.spec.features.sampling_rate))
                if progress:
                    progress(i + 1, len(samples))
        finally:
            runner.close()
        return recorder.feeds

    def run(self, runner, samples: Sequence[AudioSample], progress: Progress | None = None) -> tuple[Timed, list[str]]:
        """Streamed log-probs per utterance, with the compute time per utterance, and greedy texts."""
        outs, lat, texts = [], [], []
        for i, s in enumerate(samples):
            audio = self._audio(s, runner.spec.features.sampling_rate)
            t0 = time.perf_counter()
            log_probs, _ = runner.stream(audio)
            lat.append((time.perf_counter() - t0) * 1e3)
            outs.append(log_probs)
            texts.append(runner.decode(log_probs, "greedy"))
            if progress:
                progress(i + 1, len(samples))
        return Timed(outs, lat), texts
