"""Decoder-only LLM adapter over a standard ONNX export with a KV cache.

The export contract (``optimum-cli export onnx`` / ``torch.onnx.export`` of Phi-3, Gemma, Gemma-2):

    inputs   input_ids [B, S] int64, attention_mask [B, P+S] int64, position_ids [B, S] int64 (optional),
             past_key_values.{i}.key / .value [B, H_kv, P, D]
    outputs  logits [B, S, V], present.{i}.key / .value [B, H_kv, P+S, D]

Prefill runs the whole prompt with an empty past (P = 0); each decode step feeds one token and
the previous ``present`` tensors as ``past`` (``kv_batch.DecodeBatch``). The backend only runs tensors;
the cache lives here.

onnxruntime-genai folders (``genai_config.json``: GroupQueryAttention, ``past_present_share_buffer``)
use the same tensor names, but past and present are one preallocated buffer that the runtime appends
to in place (``kv_slots.SlotCache``, through ONNX Runtime IO binding); no position_ids, right padding.

A stateful model (OpenVINO IR with ``beam_idx``: the NPU plugin's LLM mode) keeps the cache inside the
runtime's infer request: one sequence at a time (``kv_state.StatefulBatch``), a fixed capacity, a prompt
prefilled up to the compiled prompt length at once and the rest through generate steps.

A long prompt can be prefilled in chunks between decode steps (``ChunkedPrefill``, ``prefill_chunk``):
each chunk runs with the chunks before it as its past (its own batch-1 cache, or its reserved slot),
and the sequence joins the batch after its last chunk, with the same cache a whole prefill makes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np

from ..backends import BindingSession, Session, SessionOptions, is_stateful, npu, open_session, optional_inputs
from ..errors import InputError, ModelError
from ..heap import pin_mmap_threshold
from .catalog import ModelRef
from .grammar import TokenVocab
from .kv_batch import DecodeBatch, left_pad
from .kv_slots import SlotCache
from .kv_state import StatefulBatch
from .llm_contract import genai_config_as_hf, read_contract
from .slot_runs import SlotRuns
from .tokenizer import Tokenizer

Row = TypeVar("Row")
KvBatch = DecodeBatch | SlotCache | StatefulBatch  # a batch of sequences decoding together, per KV layout
log = logging.getLogger(__name__)


class ChunkedPrefill(Generic[Row]):
    """A prompt being prefilled a chunk at a time, outside the batch that decodes, until it joins it."""

    def __init__(self, row: Row, prompt: Sequence[int], reach: int | None = None) -> None:
        self.row, self.prompt, self.reach = row, list(prompt), reach  # reach: as for ``DecoderLM.join``
        self.done = 0  # prompt tokens already in the cache
        self.past: dict[str, np.ndarray] | None = None  # its own batch-1 cache (DecodeBatch exports)
        self.cached = 0  # of ``done``, tokens a prefix cache gave (``past`` holds them until the first chunk)
        self.looked_up = False  # whether the prefix cache was asked

    def start_from(self, tokens: int, kv: dict[str, np.ndarray]) -> None:
        """Begin after a cached prefix: ``tokens`` prompt tokens whose KV is ``kv`` (per cache name,
        [1, H, tokens, D], in the batch's names: ``past_key_values.*`` or the slot buffers')."""
        if self.done:
            raise ValueError("a prefix can only be given before the first chunk")
        self.done = self.cached = tokens
        self.past = kv or None

    @property
    def started(self) -> bool:
        """Whether a chunk has run (it then holds its slot, or its cache grew past the cached prefix)."""
        return self.done > self.cached

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.done


def open_tokenizer(ref: ModelRef) -> Tokenizer:
    """The folder's tokenizer. genai and IR folders name the architecture in their config (what picks a
    built-in chat template)."""
    if ref.model_type == "genai":
        model_type = genai_config_as_hf(ref.config)[0].get("model_type", ref.model_type)
    elif ref.model_type == "openvino-ir":
        model_type = ref.config.get("model_type", ref.model_type)
    else:
        model_type = ref.model_type
    return Tokenizer(ref.path, model_type)


# the output formats' token tables of the loaded models, one per tokenizer (``DecoderLM.token_vocab``)
_VOCABS: weakref.WeakValueDictionary[tuple, TokenVocab] = weakref.WeakValueDictionary()
_VOCABS_LOCK = threading.Lock()


class DecoderLM:
    """One loaded decoder model: tokenizer, contract and session; batches are ``new_batch()`` objects."""

    def __init__(
        self, ref: ModelRef, session: Session, kv_capacity: int = 4096, tokenizer: Tokenizer | None = None
    ) -> None:
        self.ref = ref
        self.session = session
        gen_path = ref.path / "generation_config.json"
        generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.shared_kv = ref.model_type == "genai"
        config, _ = genai_config_as_hf(ref.config) if self.shared_kv else (ref.config, None)
        self.config = config  # config.json fields (for genai folders, translated from genai_config.json)
        # a stateful session (the NPU's LLM mode) holds one sequence in its own KV state
        self.stateful = is_stateful(session)
        self.npu_shape: npu.LlmShape | None = getattr(session, "npu_llm", None) if self.stateful else None
        capacity = self.npu_shape.capacity if self.npu_shape else (kv_capacity if self.stateful else None)
        self.contract = read_contract(session, config, generation_config, capacity)
        if self.shared_kv:
            self.contract = replace(self.contract, max_context=min(self.contract.max_context, kv_capacity))
        # in-place KV buffers (genai folders) are run through the session's I/O binding
        binding = session if isinstance(session, BindingSession) else None
        if self.shared_kv and binding is None:
            raise ModelError(f"{ref.name}: onnxruntime-genai folders run on ONNX Runtime only")
        self.tokenizer = tokenizer or open_tokenizer(ref)
        out = {s.name: s for s in session.outputs}
        vocab = out["logits"].shape[-1] if "logits" in out else None
        self._vocab = vocab if isinstance(vocab, int) else int(config.get("vocab_size", 0) or 0)
        # Ids past the tokenizer's are never picked (real Phi-3: 32,064 logits for 32,011 tokens)
        limit = self.tokenizer.id_limit
        self.vocab_limit: int | None = limit if 0 < limit < self._vocab else None
        self._token_vocab: TokenVocab | None = None
        self._vocab_lock = threading.Lock()
        self._slots = SlotRuns(binding, self._vocab, self.contract.has_position_ids) if binding else None
        # Serving reads the last position's logits only: an export that can skip the rest (an imported
        # decoder's logits_to_keep) is told so, sparing the head a matmul per prompt token.
        self._last_only = (
            {"logits_to_keep": np.array(1, dtype=np.int64)} if "logits_to_keep" in optional_inputs(session) else {}
        )

    @property
    def max_rows(self) -> int | None:
        """The most sequences one batch can hold (None: as many as the scheduler's limits say)."""
        return StatefulBatch.max_rows if self.stateful else None

    @property
    def _slot_runs(self) -> SlotRuns:
        if self._slots is None:  # refused at open: only genai folders take this path
            raise ModelError(f"{self.ref.name}: in-place KV buffers need a session with I/O binding")
        return self._slots

    @property
    def full_width_mask(self) -> bool:
        """Whether in-place decode steps feed the mask at the full KV width (decided at warmup)."""
        return self._slots is not None and self._slots.full_width_mask

    @full_width_mask.setter
    def full_width_mask(self, value: bool) -> None:
        self._slot_runs.full_width_mask = value

    @property
    def token_vocab(self) -> TokenVocab:
        """The vocabulary for output constraints and logprob bytes (built on first use, then kept), shared
        with every other loaded model of the same tokenizer, logits and end tokens (the ladder's rungs of
        one model: Gemma 3's 262k tokens take seconds to build)."""
        with self._vocab_lock:
            if self._token_vocab is None:
                n_logits = self._vocab or self.tokenizer.vocab_size
                tok = self.tokenizer
                text = tok.to_json()
                key = (hashlib.sha256(text.encode()).hexdigest(), n_logits, tuple(sorted(self.contract.eos_ids)))
                with _VOCABS_LOCK:
                    vocab = _VOCABS.get(key)
                if vocab is None:  # built outside the shared lock: another tokenizer's build need not wait
                    vocab = TokenVocab(text, n_logits, self.contract.eos_ids, tok.vocab_size)
                    with _VOCABS_LOCK:
                        vocab = _VOCABS.setdefault(key, vocab)
                self._token_vocab = vocab
            return self._token_vocab

    @classmethod
    def open(
        cls, ref: ModelRef, backend: str = "onnxruntime", options: SessionOptions | None = None, kv_capacity: int = 4096
    ) -> DecoderLM:
        if ref.kind != "llm":
            raise ModelError(f"{ref.name} is a {ref.kind} model, not an LLM")
        filename = "model.onnx"
        if ref.model_type == "genai":
            if backend != "onnxruntime":
                raise ModelError(
                    f"{ref.name} is an onnxruntime-genai folder (GroupQueryAttention, a contrib op): "
                    f"it runs on --backend onnxruntime, not {backend}"
                )
            _, filename = genai_config_as_hf(ref.config)
        elif ref.model_type == "openvino-ir":
            filename = "openvino_model.xml"
            if backend != "openvino":
                raise ModelError(f"{ref.name} is an OpenVINO IR folder: it runs on --backend openvino, not {backend}")
        options = options or SessionOptions()
        # Large blocks mapped apart, and an in-place KV graph (its cache bound, not allocated per step) run
        # without ONNX Runtime's arena: what a long prompt's buffers took is returned once it is done (peak RSS
        # serving Gemma 3 270M's int4 engine: 678 -> 586 MB). A plain graph allocates its growing cache every
        # step, which the arena serves faster (a 1,024-token prefill took 1.5x as long without it).
        pin_mmap_threshold()
        if backend == "onnxruntime" and ref.model_type == "genai":
            options = replace(options, extra={"cpu_arena": False, **options.extra})
        if backend == "openvino" and npu.is_npu(options.device) and "npu_llm" not in options.extra:
            # the NPU runs LLMs in its plugin's LLM mode only: a prompt length and a KV capacity to compile
            window = ref.config.get("sliding_window")
            extra = {**options.extra, "npu_llm": npu.LlmShape(), "sliding_window": window}
            options = replace(options, extra=extra)
        # The tokenizer first: parsing a large one (Gemma 3's) peaks ~270 MB above what it keeps, and with the
        # weights not yet loaded that burst no longer sets the process's peak.
        tokenizer = open_tokenizer(ref)
        # The adapter warms up itself, through its real prefill and decode path, once it knows the contract.
        session = open_session(Path(ref.path) / filename, backend, options, warmup=lambda _session: None)
        try:
            lm = cls(ref, session, kv_capacity, tokenizer)
            lm.warmup()
        except BaseException:
            session.close()
            raise
        return lm

    def warmup(self) -> None:
        """A real two-token prefill and one decode step, so first-request latency is honest. With in-place KV
        buffers the step runs twice, with the mask at its exact width and at the full KV width: the full width
        is what decode steps then use (bound once, no mask to build per step), if the logits are the same.
        GroupQueryAttention graphs read only the mask's row sums; a graph that reads more keeps the exact width."""
        exact = self._warm_step()
        if self.shared_kv:
            self.full_width_mask = True
            full = self._warm_step()
            self.full_width_mask = bool(np.allclose(full, exact, rtol=1e-5, atol=1e-6))
            if not self.full_width_mask:
                log.info(
                    "%s: its graph reads more of the attention mask than its sums: exact-width masks", self.ref.name
                )

    def _warm_step(self) -> np.ndarray:
        batch = self.new_batch(1)
        self.join(batch, [None], [[1, 2]], reach=[3])
        return self.decode(batch, [3])

    def warm_slots(self, batch: KvBatch) -> None:
        """Run a two-token prompt through every slot of an empty in-place ``batch`` and one decode step
        with all of them, then free them: ONNX Runtime's first run into each slot costs several times a
        normal prefill (~150 ms on a 28 M model), which the first burst of requests would otherwise pay.
        A ``DecodeBatch`` (plain export) has no slots and is left alone."""
        if not isinstance(batch, SlotCache) or len(batch):
            return
        rows = list(range(batch.max_rows))
        try:
            self.join(batch, rows, [[1, 2]] * len(rows), reach=[3] * len(rows))
            self.decode(batch, [3] * len(rows))
        finally:
            batch.remove(range(len(batch)))

    # -- batches of sequences decoding together ---------------------------------------------

    def new_batch(self, max_rows: int) -> KvBatch:
        if self.max_rows is not None:
            return StatefulBatch(self.contract.max_context)
        if not self.shared_kv:
            return DecodeBatch()
        c = self.contract
        names = [f"{i}.{kv}" for i in range(c.num_layers) for kv in ("key", "value")]
        return SlotCache(names, max_rows, c.num_kv_heads, c.max_context, c.head_dim, c.kv_dtype)

    def join(
        self,
        batch: KvBatch,
        rows: Sequence,
        prompts: Sequence[Sequence[int]],
        reach: Sequence[int | None] | None = None,
    ) -> np.ndarray:
        """Prefill ``prompts`` and add them to ``batch`` as ``rows``: their last logits [n, V]. ``reach``: the
        most tokens each row may hold (prompt + max_new_tokens), which sizes in-place KV buffers (default:
        the model's context)."""
        if isinstance(batch, StatefulBatch):
            if len(rows) != 1 or batch.busy:
                raise ModelError(f"{self.ref.name} holds one sequence at a time (a stateful model)")
            self._restart(batch)
            try:
                logits = self._feed(batch, prompts[0])
            except BaseException:
                batch.length = 0
                raise
            batch.rows.append(rows[0])
            return logits
        if isinstance(batch, DecodeBatch):
            logits, past, mask = self.prefill(prompts)
            batch.add(rows, past, mask)
            return logits
        first = len(batch)
        out = []
        try:
            for i, (row, prompt) in enumerate(zip(rows, prompts)):
                # Prompts are prefilled one by one into their own slot: prefill is compute bound, so
                # batching them would save little, and GroupQueryAttention wants right padding.
                slot = batch.claim(row, len(prompt), reach[i] if reach is not None else None)
                ids = np.asarray([prompt], dtype=np.int64)
                out.append(
                    self._slot_runs.rows(
                        batch, slot, 1, ids, np.ones_like(ids), np.arange(len(prompt), dtype=np.int64)[None]
                    )[:, -1]
                )
        except BaseException:
            batch.remove(range(first, len(batch)))
            raise
        return np.concatenate(out, axis=0)

    def prefill_chunk(self, batch: KvBatch, state: ChunkedPrefill, n: int) -> np.ndarray | None:
        """Prefill the next ``n`` prompt tokens of ``state``. After the last chunk it joins ``batch`` as its
        last row and its last logits [1, V] come back; before, None. A failure frees what it held."""
        end = min(state.done + n, len(state.prompt))
        if isinstance(batch, StatefulBatch):
            try:
                if state.done == 0:
                    if batch.busy:
                        raise ModelError(f"{self.ref.name} holds one sequence at a time (a stateful model)")
                    self._restart(batch)
                    batch.pending = state.row
                logits = self._feed(batch, state.prompt[state.done : end])
            except BaseException:
                self.abandon(batch, state)
                raise
            state.done = end
            if state.remaining:
                return None
            batch.pending = None
            batch.rows.append(state.row)
            return logits
        ids = np.asarray([state.prompt[state.done : end]], dtype=np.int64)
        mask = np.ones((1, end), dtype=np.int64)
        try:
            if isinstance(batch, SlotCache):
                slot = len(batch)
                if not state.started:  # its first chunk: hold the next slot, with a cached prefix in it
                    batch.reserve(state.row, len(state.prompt), state.reach)
                    if state.past:
                        batch.load_pending(state.past)
                    state.past = None
                positions = np.arange(state.done, end, dtype=np.int64)[None]
                logits = self._slot_runs.rows(batch, slot, 1, ids, mask, positions)
                batch.pending_length = end
            else:
                logits, state.past = self.forward(ids, mask, state.past or self._empty_past(1))
        except BaseException:
            self.abandon(batch, state)
            raise
        state.done = end
        if state.remaining:
            return None
        if isinstance(batch, SlotCache):
            batch.commit()
        else:
            batch.add([state.row], state.past or {}, mask)
            state.past = None
        return logits[:, -1]

    def abandon(self, batch: KvBatch, state: ChunkedPrefill) -> None:
        """Free what a chunked prefill holds (its reserved slot or its own cache)."""
        if isinstance(batch, SlotCache) and batch.pending is state.row:
            batch.release()
        if isinstance(batch, StatefulBatch) and batch.pending is state.row:
            batch.pending, batch.length = None, 0
        state.past = None

    def decode(self, batch: KvBatch, tokens: Sequence[int]) -> np.ndarray:
        """One step for every row of ``batch`` (one new token each): last logits [B, V]; advances the cache."""
        if isinstance(batch, StatefulBatch):
            return self._feed(batch, tokens)
        if isinstance(batch, SlotCache):
            return self._slot_runs.decode(batch, tokens)
        ids = np.asarray(tokens, dtype=np.int64)[:, None]
        mask = batch.step_mask()
        logits, present = self.forward(ids, mask, batch.past)
        batch.advance(present, mask)
        return logits[:, -1]

    def decode_runs(self, batch: KvBatch, runs: Sequence[Sequence[int]]) -> np.ndarray:
        """One step in which row i takes the tokens ``runs[i]``: one, or a run its output format forced after
        the one it picked (jump-forward decoding). Last logits [B, V], as ``decode`` gives for one each."""
        if len(runs) == 1 and len(runs[0]) > 1:  # a lone row: its whole run in one pass
            return self.extend(batch, 0, runs[0])
        for i, run in enumerate(runs):
            if len(run) > 1:
                self.extend(batch, i, run[:-1])
        return self.decode(batch, [run[-1] for run in runs])

    def extend(self, batch: KvBatch, index: int, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (one or more) to row ``index``'s cache alone, in one forward pass: its last
        logits [1, V]."""
        if isinstance(batch, StatefulBatch):
            return self._feed(batch, tokens)
        ids = np.asarray([tokens], dtype=np.int64)
        if isinstance(batch, SlotCache):
            start = batch.lengths[index]
            batch.make_room_for(index, len(tokens))
            mask = np.ones((1, start + len(tokens)), dtype=np.int64)
            positions = np.arange(start, start + len(tokens), dtype=np.int64)[None]
            logits = self._slot_runs.rows(batch, index, 1, ids, mask, positions)
            batch.grow(index, len(tokens))
            return logits[:, -1]
        mask = np.concatenate([batch.mask[index : index + 1], np.ones_like(ids)], axis=1)
        past = {name: value[index : index + 1] for name, value in batch.past.items()}
        logits, present = self.forward(ids, mask, past)
        batch.replace_row(index, present, mask)
        return logits[:, -1]

    def _restart(self, batch: StatefulBatch) -> None:
        self.session.reset_state()  # type: ignore[attr-defined]  # a stateful session (is_stateful)
        batch.length = 0

    def _feed(self, batch: StatefulBatch, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids`` to the stateful sequence: last logits [1, V]. The first run after a restart is the
        prefill (at most the compiled prompt length); the rest of the prompt goes through generate steps of
        at most the compiled generate length, as decoded tokens do."""
        if batch.length + len(ids) > batch.capacity:
            raise InputError(
                f"{batch.length + len(ids)} tokens exceed the {batch.capacity} that {self.ref.name}'s KV state "
                "holds on this device"
            )
        shape = self.npu_shape
        logits = None
        done = 0
        while done < len(ids):
            size = len(ids) if shape is None else shape.max_prompt if batch.length == 0 else shape.generate_tokens
            chunk = ids[done : done + size]
            logits = self.session.run(batch.step_feeds(chunk), ["logits"])["logits"]
            batch.length += len(chunk)
            done += len(chunk)
        assert logits is not None, "nothing to feed"
        return logits[:, -1]

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        c = self.contract
        shape = (batch, c.num_kv_heads, 0, c.head_dim)
        empty = np.zeros(shape, dtype=np.dtype(c.kv_dtype))
        return {f"past_key_values.{i}.{kv}": empty for i in range(c.num_layers) for kv in ("key", "value")}

    def forward(
        self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray], every_position: bool = False
    ) -> tuple[np.ndarray, dict]:
        """One forward pass. ``ids`` [B, S]; ``mask`` [B, P+S]; returns logits [B, S, V] (``every_position``)
        or at least the last position's ([B, 1, V] where the export can skip the rest), and the new past."""
        feeds = {"input_ids": ids, "attention_mask": mask, **past}
        if not every_position:
            feeds.update(self._last_only)
        if self.contract.has_position_ids:
            # Left padding: positions count real tokens only.
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
            feeds["position_ids"] = positions.astype(np.int64)
        out = self.session.run(feeds)
        new_past = {
            name.replace("present.", "past_key_values.", 1): v for name, v in out.items() if name.startswith("present.")
        }
        return out["logits"], new_past

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Run prompts of any lengths as one left-padded batch: last-position logits [n, V], cache, mask."""
        ids, mask = left_pad(prompts)
        logits, past = self.forward(ids, mask, self._empty_past(len(prompts)))
        return logits[:, -1], past, mask

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise InputError("the prompt is empty")
        if self.npu_shape is not None and len(prompt_ids) < 2:
            # the plugin's LLM mode takes a one-token run for a generate step: a sequence starts with two
            raise InputError("the NPU's LLM mode prefills prompts of two tokens or more; this one has one")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        total = len(prompt_ids) + max_new_tokens
        if total > self.contract.max_context:
            raise InputError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.contract.max_context} tokens"
            )

    def generate_greedy(
        self, prompt_ids: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True, known_only: bool = True
    ) -> Iterator[int]:
        """Greedy decoding with the KV cache, yielding each new token id as soon as it exists; with
        ``known_only`` (as served) among the ids the tokenizer defines, else over every logit."""
        width = self.vocab_limit if known_only and self.vocab_limit is not None else None
        self.check_prompt(prompt_ids, max_new_tokens)
        if self.max_rows is not None:  # a stateful model: through its one-sequence batch
            batch = self.new_batch(1)
            last = self.join(batch, [None], [prompt_ids])
            try:
                for step in range(max_new_tokens):
                    token = int(np.argmax(last[0, :width]))
                    yield token
                    if (stop_at_eos and token in self.contract.eos_ids) or step == max_new_tokens - 1:
                        return
                    last = self.decode(batch, [token])
            finally:
                batch.remove(range(len(batch)))
            return
        ids = np.asarray([prompt_ids], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, past = self.forward(ids, mask, self._empty_past(1))
        for step in range(max_new_tokens):
            token = int(np.argmax(logits[0, -1, :width]))
            yield token
            if (stop_at_eos and token in self.contract.eos_ids) or step == max_new_tokens - 1:
                return
            mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
            logits, past = self.forward(np.asarray([[token]], dtype=np.int64), mask, past)

    def close(self) -> None:
        self.session.close()
