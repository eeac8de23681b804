"""Whisper on the NPU: every graph with static shapes, the decoder's cache a fixed number of slots.

The NPU compiles static shapes only, and Whisper's decoder grows its self-attention cache with every
token. As OpenVINO GenAI's static Whisper pipeline does, the NPU runs three static graphs instead:

- the encoder (``encoder_model.onnx``) reshaped to one stream of 30 s, ``input_features`` [1, mels, 3000];
- the cross-attention keys and values of every decoder layer from the encoder states, once per pass
  (``whisper_graph.build_cross_kv``: [1, 1500, d] -> [1, H, 1500, d/H] per layer);
- the decoder step (``whisper_graph.build_decoder_step``): one token, its position, a mask over the
  ``capacity`` slots of the cache (unused slots masked out), the cache and the cross keys/values ->
  the logits and the step's own key and value, which this module writes into the slot of its position.

The prompt (``<|startoftranscript|>``, language, task, ``<|notimestamps|>``) and the committed tokens are
fed one token at a time. The two decoder graphs are built when the tier loads, with the same builder as
the folder's other graphs and from the tensors of its ``decoder_model.onnx``: the weights are the ones
the CPU serves, bit for bit, and nothing more is stored on disk. Only folders written by
``edge-agent models import`` (a CTranslate2 Whisper) have those graphs; another export is refused,
naming what to import instead.

Serving on the NPU: one stream at a time (batch 1; streams take turns within a step), every pass
(partial or final) a 30 s one (no short-context partials: the encoder's shape is fixed), greedy with
the CPU's suppression rules. The cache holds ``capacity`` positions (default: the model's
``max_target_positions``, 448, what the CPU's decoder holds too); a decode that reaches it stops there
and says so in the log, and feeding past it is an error, never a silent overwrite.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..backends import Session, SessionOptions, open_session
from ..errors import InputError, ModelError
from ..graphs.whisper import MASKED_SCORE as _NEG
from ..graphs.whisper import WhisperDims, build_cross_kv, build_decoder_step
from .asr_whisper import WhisperRecognizer
from .catalog import ModelRef

log = logging.getLogger(__name__)
PRODUCER = "edge-agent ct2-whisper"  # the producer_name of the graphs models import writes
_INLINE_LIMIT = 1 << 30  # larger graphs keep their weights in an external data file (protobuf stops at 2 GiB)


def dims_of(ref: ModelRef) -> WhisperDims:
    """The model's sizes from its ``config.json`` (transformers' names, as the import writes them)."""
    c = ref.config
    try:
        return WhisperDims(
            n_mels=int(c["num_mel_bins"]),
            d_model=int(c["d_model"]),
            encoder_layers=int(c["encoder_layers"]),
            encoder_heads=int(c["encoder_attention_heads"]),
            decoder_layers=int(c["decoder_layers"]),
            decoder_heads=int(c["decoder_attention_heads"]),
            ffn=int(c["decoder_ffn_dim"]),
            vocab=int(c["vocab_size"]),
            source_positions=int(c.get("max_source_positions", 1500)),
            target_positions=int(c.get("max_target_positions", 448)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{ref.name}: config.json lacks Whisper's sizes ({exc})") from exc


def _refusal(ref: ModelRef, what: str) -> ModelError:
    return ModelError(
        f"{ref.name}: {what}. The NPU runs Whisper through static decoder graphs built from the folder that "
        "`edge-agent models import DIR` writes from a CTranslate2 (faster-whisper) Whisper folder "
        "(`edge-agent models fetch whisper-base` fetches and imports one); import the model's CTranslate2 "
        "folder and serve that on the NPU, or serve this folder on the CPU"
    )


def build_npu_graphs(ref: ModelRef, out: Path, capacity: int) -> tuple[Path, Path]:
    """Write the decoder step and the cross keys/values graphs of ``ref`` into ``out``: built with the
    folder's own graph builder from the initializers of its ``decoder_model.onnx``."""
    import onnx
    from onnx import numpy_helper

    first = Path(ref.path) / "decoder_model.onnx"
    if not first.is_file():
        raise _refusal(ref, "no decoder_model.onnx")
    model = onnx.load(str(first))
    if model.producer_name != PRODUCER:
        made_by = model.producer_name or "an unnamed exporter"
        raise _refusal(ref, f"its graphs come from {made_by!r}, not from `edge-agent models import`")
    dims = dims_of(ref)
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    del model
    try:
        graphs = {
            "decoder_step_model.onnx": build_decoder_step(dims, capacity, stored=stored),
            "cross_kv_model.onnx": build_cross_kv(dims, stored=stored),
        }
    except KeyError as exc:
        raise _refusal(ref, f"its decoder_model.onnx has no tensor {exc} (imported by another version?)") from exc
    paths = []
    for name, graph in graphs.items():
        path = out / name
        size = sum(t.ByteSize() for t in graph.graph.initializer)
        external = size > _INLINE_LIMIT
        onnx.save_model(graph, str(path), save_as_external_data=external, location=f"{name}.data" if external else None)
        paths.append(path)
    return paths[0], paths[1]


class NpuWhisperRecognizer(WhisperRecognizer):
    """``WhisperRecognizer`` on the NPU: a static encoder, the decoder step with a fixed cache, batch 1."""

    def __init__(self, ref: ModelRef, encoder: Session, step: Session, cross: Session, capacity: int, **kwargs) -> None:
        super().__init__(ref, encoder, None, None, **kwargs)
        dims = dims_of(ref)
        self.step_session, self.cross_session = step, cross
        self.capacity = capacity
        self.max_positions = min(self.max_positions, capacity)
        self.short_context = False  # the encoder's shape is fixed: every pass is 30 s
        heads, dh = dims.decoder_heads, dims.d_model // dims.decoder_heads
        self._cache = {
            f"past_key_values.{i}.decoder.{kind}": np.zeros((1, heads, capacity, dh), np.float32)
            for i in range(dims.decoder_layers)
            for kind in ("key", "value")
        }
        self._mask = np.full((1, capacity), _NEG, np.float32)
        self._cross: dict[str, np.ndarray] = {}
        self._position = 0

    @classmethod
    def open(
        cls, ref: ModelRef, backend: str = "openvino", options: SessionOptions | None = None, **kwargs
    ) -> NpuWhisperRecognizer:
        if backend != "openvino":
            raise ModelError(f"{ref.name}: the NPU is reached through OpenVINO, not {backend}")
        options = options or SessionOptions(device="NPU")
        capacity = int(kwargs.pop("npu_capacity", None) or dims_of(ref).target_positions)
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k in ("language", "task", "suppress", "min_step_s", "max_tokens_per_s", "guards")
        }
        encoder_path = Path(ref.path) / "encoder_model.onnx"
        if not encoder_path.is_file():
            raise ModelError(f"{ref.path}: missing encoder_model.onnx")
        sessions: list[Session] = []
        try:
            with tempfile.TemporaryDirectory(prefix="edge-agent-npu-whisper-") as tmp:
                step_path, cross_path = build_npu_graphs(ref, Path(tmp), capacity)
                for path in (step_path, cross_path):
                    sessions.append(open_session(path, backend, replace(options, static_shapes=None), warmup=_none))
            dims = dims_of(ref)
            static = {"input_features": (1, dims.n_mels, 2 * dims.source_positions)}
            encoder = open_session(encoder_path, backend, replace(options, static_shapes=static), warmup=_none)
        except BaseException:
            for s in sessions:
                s.close()
            raise
        engine = cls(ref, encoder, sessions[0], sessions[1], capacity, **kwargs)
        engine.transcribe(np.zeros(engine.sample_rate, np.float32))  # real warm-up
        log.info("%s on the NPU: a 30 s encoder, a decoder cache of %d positions, batch 1", ref.name, capacity)
        return engine

    # -- model calls: one row at a time ---------------------------------------------------------

    def encode_features(self, features: np.ndarray) -> np.ndarray:
        rows = [
            self.encoder.run({"input_features": features[r : r + 1].astype(np.float32)}, ["last_hidden_state"])[
                "last_hidden_state"
            ]
            for r in range(features.shape[0])
        ]
        return np.concatenate(rows)

    def start(self, hidden: np.ndarray) -> None:
        """A new decode over one row's encoder states [1, T, d]: its cross keys/values, an empty cache."""
        out = self.cross_session.run({"encoder_hidden_states": np.ascontiguousarray(hidden, np.float32)})
        self._cross = {k.replace("present.", "past_key_values.", 1): v for k, v in out.items()}
        self._mask.fill(_NEG)
        self._position = 0

    def feed(self, token: int) -> np.ndarray:
        """One token at the next position; its logits [V]. The cache holds ``capacity`` positions."""
        pos = self._position
        if pos >= self.capacity:
            raise InputError(
                f"{self.name}: the NPU decoder's cache holds {self.capacity} positions (prompt and tokens), "
                "and this decode would go past it"
            )
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([[token]], np.int64),
            "position_ids": np.array([[pos]], np.int64),
            "cache_mask": self._mask,
            **self._cache,
            **self._cross,
        }
        out = self.step_session.run(feeds)
        for name, value in out.items():
            if name != "logits":
                self._cache[name.replace("present.", "past_key_values.", 1)][:, :, pos] = value[:, :, 0]
        self._mask[0, pos] = 0.0
        self._position = pos + 1
        return out["logits"][0, -1]

    def detect_language(self, hidden: np.ndarray) -> list[str]:
        names, ids = list(self.lang_to_id), np.array(list(self.lang_to_id.values()))
        found = []
        for r in range(hidden.shape[0]):
            self.start(hidden[r : r + 1])
            found.append(names[int(np.argmax(self.feed(self.sot)[ids]))])
        return found

    def decode(
        self,
        hidden: np.ndarray,
        prompts: Sequence[Sequence[int]],
        forced: Sequence[Sequence[int]],
        max_new: Sequence[int],
        suppress: bool = True,
        stop_at_eot: bool = True,
        drafts: Sequence[Sequence[int]] | None = None,
        guard: bool = False,
    ) -> list[list[int]]:
        """Greedy, one row after the other, with the choices and limits of ``WhisperRecognizer.decode``
        (``drafts`` unused: the fixed cache is fed one token at a time)."""
        return [
            self._decode_row(hidden[r : r + 1], prompts[r], forced[r], max_new[r], suppress, stop_at_eot, guard)
            for r in range(hidden.shape[0])
        ]

    def _decode_row(
        self,
        hidden: np.ndarray,
        prompt: Sequence[int],
        forced: Sequence[int],
        max_new: int,
        suppress: bool,
        stop_at_eot: bool,
        guard: bool,
    ) -> list[int]:
        if len(prompt) >= self.max_positions:
            raise InputError(f"{self.name}: a prompt of {len(prompt)} tokens leaves no room in the decoder's cache")
        self.start(hidden)
        if guard and not forced:  # judged on a lone <|startoftranscript|>, then its slot is given back
            if self._silent(self.feed(self.sot)):
                return []
            self._mask.fill(_NEG)
            self._position = 0
        for token in prompt:
            logits = self.feed(int(token))
        return self._greedy(logits, [], len(prompt), forced, max_new, self.feed, suppress, stop_at_eot, guard)

    def close(self) -> None:
        for s in (self.encoder, self.step_session, self.cross_session):
            s.close()


def _none(_session: Session) -> None:
    return None
