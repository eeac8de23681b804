"""Decoder-only LLM adapter over a standard ONNX export with a KV cache.

The export contract (``optimum-cli export onnx`` / ``torch.onnx.export`` of Phi-3, Gemma, Gemma-2):

    inputs   input_ids [B, S] int64, attention_mask [B, P+S] int64, position_ids [B, S] int64 (optional),
             past_key_values.{i}.key / .value [B, H_kv, P, D]
    outputs  logits [B, S, V], present.{i}.key / .value [B, H_kv, P+S, D]

Prefill runs the whole prompt with an empty past (P = 0); each decode step feeds one token and
the previous ``present`` tensors as ``past``. The backend only runs tensors; the cache lives here.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..backends import Session, SessionOptions, open_session
from ..errors import InputError, ModelError
from .catalog import ModelRef
from .kv_batch import DecodeBatch, left_pad
from .tokenizer import Tokenizer

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclass(frozen=True, slots=True)
class LlmContract:
    """What the adapter needs to know about an export, read from its I/O specs and config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    has_position_ids: bool
    max_context: int
    eos_ids: frozenset[int]
    bos_id: int | None


def read_contract(session: Session, config: dict, generation_config: dict) -> LlmContract:
    names = {s.name: s for s in session.inputs}
    for required in ("input_ids", "attention_mask"):
        if required not in names:
            raise ModelError(f"not a decoder export with a KV cache: no {required!r} input (inputs: {sorted(names)})")
    layers = sorted({int(m.group(1)) for n in names if (m := _PAST.match(n))})
    if not layers or layers != list(range(len(layers))):
        raise ModelError("the export has no past_key_values.N.key/value inputs: export it with its KV cache "
                         "(optimum-cli export onnx --task text-generation-with-past)")
    spec = names["past_key_values.0.key"]
    heads, head_dim = spec.shape[1], spec.shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
    return LlmContract(
        num_layers=len(layers),
        num_kv_heads=heads,
        head_dim=head_dim,
        kv_dtype=spec.dtype,
        has_position_ids="position_ids" in names,
        max_context=int(config.get("max_position_embeddings", 4096)),
        eos_ids=eos_ids,
        bos_id=bos if isinstance(bos, int) else None,
    )


class DecoderLM:
    """One loaded decoder model: tokenizer, contract and session (one sequence at a time)."""

    def __init__(self, ref: ModelRef, session: Session) -> None:
        self.ref = ref
        self.session = session
        gen_path = ref.path / "generation_config.json"
        generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.contract = read_contract(session, ref.config, generation_config)
        self.tokenizer = Tokenizer(ref.path, ref.model_type)

    @classmethod
    def open(cls, ref: ModelRef, backend: str = "onnxruntime", options: SessionOptions | None = None) -> DecoderLM:
        if ref.kind != "llm":
            raise ModelError(f"{ref.name} is a {ref.kind} model, not an LLM")
        if ref.model_type in ("genai", "openvino-ir"):
            raise ModelError(f"{ref.name}: {ref.model_type} folders are served by the LLM runtime, not this adapter yet")
        session = open_session(Path(ref.path) / "model.onnx", backend, options, warmup=_warmup)
        return cls(ref, session)

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        c = self.contract
        shape = (batch, c.num_kv_heads, 0, c.head_dim)
        empty = np.zeros(shape, dtype=np.dtype(c.kv_dtype))
        return {f"past_key_values.{i}.{kv}": empty for i in range(c.num_layers) for kv in ("key", "value")}

    def forward(self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        """One forward pass. ``ids`` [B, S]; ``mask`` [B, P+S]; returns logits [B, S, V] and the new past."""
        feeds = {"input_ids": ids, "attention_mask": mask, **past}
        if self.contract.has_position_ids:
            # Left padding: positions count real tokens only.
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1]:]
            feeds["position_ids"] = positions.astype(np.int64)
        out = self.session.run(feeds)
        new_past = {name.replace("present.", "past_key_values.", 1): v for name, v in out.items() if name.startswith("present.")}
        return out["logits"], new_past

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Run prompts of any lengths as one left-padded batch: last-position logits [n, V], cache, mask."""
        ids, mask = left_pad(prompts)
        logits, past = self.forward(ids, mask, self._empty_past(len(prompts)))
        return logits[:, -1], past, mask

    def decode(self, batch: DecodeBatch, tokens: Sequence[int]) -> np.ndarray:
        """One step for every row of ``batch`` (one new token each): last logits [B, V]; advances the cache."""
        mask = batch.step_mask()
        logits, present = self.forward(np.asarray(tokens, dtype=np.int64)[:, None], mask, batch.past)
        batch.advance(present, mask)
        return logits[:, -1]

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise InputError("the prompt is empty")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        total = len(prompt_ids) + max_new_tokens
        if total > self.contract.max_context:
            raise InputError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.contract.max_context} tokens"
            )

    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> Iterator[int]:
        """Greedy decoding with the KV cache, yielding each new token id as soon as it exists."""
        self.check_prompt(prompt_ids, max_new_tokens)
        ids = np.asarray([prompt_ids], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, past = self.forward(ids, mask, self._empty_past(1))
        for step in range(max_new_tokens):
            token = int(np.argmax(logits[0, -1]))
            yield token
            if (stop_at_eos and token in self.contract.eos_ids) or step == max_new_tokens - 1:
                return
            mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
            logits, past = self.forward(np.asarray([[token]], dtype=np.int64), mask, past)

    def close(self) -> None:
        self.session.close()


def _warmup(session: Session) -> None:
    """Run a real prefill of two tokens and one decode step, so first-request latency is honest."""
    names = {s.name: s for s in session.inputs}
    layers = sorted({int(m.group(1)) for n in names if (m := _PAST.match(n))})
    if not layers:
        return  # read_contract reports the problem with a clear message
    spec = names["past_key_values.0.key"]
    heads = spec.shape[1] if isinstance(spec.shape[1], int) else 1
    dim = spec.shape[3] if isinstance(spec.shape[3], int) else 1
    empty = np.zeros((1, heads, 0, dim), dtype=np.dtype(spec.dtype))
    feeds = {"input_ids": np.ones((1, 2), np.int64), "attention_mask": np.ones((1, 2), np.int64)}
    feeds.update({f"past_key_values.{i}.{kv}": empty for i in layers for kv in ("key", "value")})
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(2, dtype=np.int64)[None]
    session.run(feeds)
