"""Runs of an in-place KV graph over a ``SlotCache``'s rows, through I/O bindings prepared once.

A prompt's run asks for the last position's logits only where the graph can skip the rest (its
optional ``logits_to_keep`` input, which in-place graphs converted by ``engines.inplace_kv`` have): the
head of a 262k-token vocabulary costs a 671 MB product per prompt token otherwise.

A run's rows ``first…first+count-1`` have past = present = their slot views, which stay the same
memory until the cache reallocates (which clears ``SlotCache.prepared``), so each binding is made once
per (session, rows) and kept with the cache. A prompt (or a chunk of one) binds its ids, mask and logits
per run; a decode step binds nothing: its input ids, its logits and, with ``full_width_mask``, the
cache's full-width attention mask are buffers bound with the KV views and written in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..backends import BindingSession, PreparedRun, optional_inputs
from .kv_slots import SlotCache


class _DecodeStep:
    """A prepared decode step of ``count`` rows and the input ids / logits buffers it binds."""

    def __init__(self, run: PreparedRun, ids: np.ndarray, logits: np.ndarray) -> None:
        self.run, self.ids, self.logits = run, ids, logits


class SlotRuns:
    """Prefill and decode runs of one session over in-place KV slots (see the module doc)."""

    def __init__(self, binding: BindingSession, vocab: int, has_position_ids: bool) -> None:
        self.binding, self.vocab, self.has_position_ids = binding, vocab, has_position_ids
        # decode steps feed the mask at the full KV width from the cache's buffer (SlotCache.mask), once the
        # model has been seen to give the same logits that way (DecoderLM.warmup)
        self.full_width_mask = False
        self.last_only = "logits_to_keep" in optional_inputs(binding)

    def rows(
        self, cache: SlotCache, first: int, count: int, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """Run rows ``first…`` (a prompt or a chunk of one): logits [count, S, V], or [count, 1, V] (the last
        position's) where the graph takes ``logits_to_keep``."""
        # a run holds its session, so the id is not reused while the entry lives
        key = (id(self.binding), first, count)
        run = cache.prepared.get(key)
        if run is None:
            run = cache.prepared[key] = self._prepare(cache, first, count)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.has_position_ids:
            feeds["position_ids"] = positions
        if self.last_only:
            feeds["logits_to_keep"] = np.array(1, dtype=np.int64)
        logits = np.empty((count, 1 if self.last_only else ids.shape[1], self.vocab), dtype=np.float32)
        run.run(feeds, {"logits": logits})
        return logits

    def decode(self, cache: SlotCache, tokens: Sequence[int]) -> np.ndarray:
        """One decode step of every row of ``cache``: last logits [B, V] (the caller's own); advances it."""
        count = len(cache)
        cache.make_room()  # before the step's binding is looked up: growing moves the buffers
        key = (id(self.binding), "decode", count)
        step = cache.prepared.get(key)
        if step is None:
            ids, logits = np.zeros((count, 1), dtype=np.int64), np.empty((count, 1, self.vocab), np.float32)
            fixed_in = {"input_ids": ids}
            if self.full_width_mask:
                fixed_in["attention_mask"] = cache.mask[:count]
            step = cache.prepared[key] = _DecodeStep(self._prepare(cache, 0, count, fixed_in, logits), ids, logits)
        step.ids[:, 0] = tokens
        feeds = {}
        if self.full_width_mask:
            cache.full_step_mask()  # in place, in the bound buffer
        else:
            feeds["attention_mask"] = cache.step_mask()
        if self.has_position_ids:
            feeds["position_ids"] = np.asarray(cache.lengths, dtype=np.int64)[:, None]
        step.run.run(feeds, {})
        cache.advance()
        return step.logits[:, 0].copy()  # the buffer is the next step's

    def _prepare(
        self, cache: SlotCache, first: int, count: int, fixed_in: dict | None = None, logits: np.ndarray | None = None
    ) -> PreparedRun:
        """Rows ``first…first+count-1`` with past = present = their slot views, plus ``fixed_in`` (and
        ``logits`` as the bound output), bound once."""
        views = cache.views(first, count)
        fixed_out = {f"present.{n}": v for n, v in views.items()}
        if logits is not None:
            fixed_out["logits"] = logits
        return self.binding.prepare_binding(
            {**{f"past_key_values.{n}": v for n, v in views.items()}, **(fixed_in or {})}, fixed_out
        )
