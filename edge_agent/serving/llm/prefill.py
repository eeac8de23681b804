"""Chunked prefill: admitted prompts enter the batch a token budget per loop turn.

Without a budget every admitted prompt is prefilled whole before the next decode step, so one long
prompt stalls every running stream for its whole prefill. With ``Limits.prefill_chunk_tokens`` a
loop turn prefills at most that many prompt tokens, then the running sequences take their decode
step: a long prompt enters over several turns, and streams keep their inter-token latency.

- ``plan_chunks`` (pure) splits the budget over the prefilling prompts, oldest first. A prompt gets
  tokens only once every older one completes this turn, so at most one prompt is part-way through
  (in-place KV caches have one slot to spare for it). With nothing decoding there is nobody to keep
  waiting, and each prompt runs whole.
- ``Prefills`` holds the prefilling sequences and runs one turn: the part-way one continues
  (``DecoderLM.prefill_chunk``), the prompts that fit whole join (``DecoderLM.join``), and the next one
  starts its first chunk. Each prompt that completes is handed on at once (``on_joined``), so its first
  token streams before the next prompt's prefill runs.
- Unless ``together``, a turn prefills one prompt (whole, or a chunk of it), and a decode step runs
  between two prompts. On a CPU prefill is compute bound: batching prompts saves nothing and makes every
  one of them wait for the last; one per turn, the first finishes first, the running streams wait one
  prefill at a time, and requests that arrived together start a turn apart, so they finish a turn apart
  and never arrive together again (in the same turn they would finish, and return, together forever).
  ``together`` (accelerators, where a batch of prompts costs little more than one): the budget is
  shared by as many prompts as fit, and the whole ones join in one batched prefill.
- With a prefix cache (``models.prefix_cache``), a prompt about to run is looked up first: a hit starts it
  after the cached tokens (``ChunkedPrefill.start_from``), so only the rest is prefilled and counted against
  the budget, through ``prefill_chunk`` (whole or in chunks). Each prompt that completes leaves its KV in the
  cache before its first token is handed on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

from ...errors import DeadlineExceeded, EdgeAgentError
from ...models.kv_batch import DecodeBatch
from ...models.kv_slots import SlotCache
from ...models.llm import ChunkedPrefill, DecoderLM, KvBatch
from ...models.prefix_cache import PrefixCache

Row = TypeVar("Row")
Joined = Callable[[int, np.ndarray], None]  # (index of the first joined row in the batch, their last logits)
log = logging.getLogger(__name__)


def plan_chunks(remaining: Sequence[int], budget: int, decoding: int, together: bool = True) -> list[int]:
    """How many prompt tokens each prefilling sequence runs this turn, oldest first (a prefix of them).

    ``remaining``: prompt tokens still to prefill per sequence, oldest first. ``budget``: tokens per
    turn (0: no limit, today's whole prefill). ``decoding``: sequences taking decode steps; with none,
    there is no stream to keep waiting and each prompt runs whole. ``together`` False: one prompt per
    turn (the oldest), so a decode step runs between two prompts' prefills.
    """
    if not together:
        if not remaining:
            return []
        return [remaining[0] if budget <= 0 or decoding == 0 else min(remaining[0], budget)]
    if budget <= 0 or decoding == 0:
        return list(remaining)
    counts = []
    left = budget
    for rest in remaining:
        take = min(rest, left)
        if take <= 0:
            break
        counts.append(take)
        left -= take
        if take < rest:
            break  # this one goes on next turn; younger ones wait behind it
    return counts


def prefill_error(exc: Exception) -> EdgeAgentError:
    """What the requests of a failed prefill get: the engine's own error, or a runtime bug named as one."""
    if isinstance(exc, EdgeAgentError):
        return exc
    log.error("prefill failed", exc_info=exc)
    return EdgeAgentError(f"prefill failed: {exc}")


def prefill_deadline(request_id: int) -> DeadlineExceeded:
    return DeadlineExceeded(f"request {request_id} reached its deadline while its prompt was being prefilled")


class Prefills(Generic[Row]):
    """The admitted sequences whose prompts are not yet all in the cache, paced by ``plan_chunks``;
    they count as running for admission and ``load``."""

    def __init__(self, lm: DecoderLM, budget: int, together: bool = False, cache: PrefixCache | None = None) -> None:
        self.lm, self.budget, self.together, self.cache = lm, budget, together, cache
        self._states: deque[ChunkedPrefill[Row]] = deque()

    def __len__(self) -> int:
        return len(self._states)

    def pending(self) -> list[tuple[Row, int]]:
        """Each sequence with the prompt tokens it has still to prefill (any thread: a snapshot)."""
        return [(s.row, s.remaining) for s in list(self._states)]

    def add(
        self,
        rows: Sequence[Row],
        prompts: Sequence[Sequence[int]],
        reach: Sequence[int | None] | None = None,
        resume: Sequence[tuple[int, dict[str, np.ndarray]] | None] | None = None,
    ) -> None:
        """Queue ``rows`` to prefill ``prompts``; ``reach``: the most tokens each may hold (``DecoderLM.join``);
        ``resume``: for a row that ran before (preempted), the tokens its KV already holds and that KV [1, H, n,
        D]: only the rest of its prompt runs, and the prefix cache is not asked."""
        reaches: Sequence[int | None] = reach if reach is not None else [None] * len(rows)
        for i, (row, prompt, r) in enumerate(zip(rows, prompts, reaches)):
            state = ChunkedPrefill(row, prompt, r)
            held = resume[i] if resume is not None else None
            if held is not None:
                state.start_from(*held)
                state.looked_up = True
            self._states.append(state)

    def tokens_left(self) -> int:
        """Prompt tokens still to prefill over every sequence here (device thread)."""
        return sum(s.remaining for s in self._states)

    def drop(self, batch: KvBatch, leaving: Callable[[Row], bool] | None = None) -> list[Row]:
        """Take out the sequences for which ``leaving(row)`` holds (all of them without it), freeing
        what they hold (a reserved slot, a part-way cache)."""
        gone = [s for s in self._states if leaving is None or leaving(s.row)]
        for state in gone:
            self._states.remove(state)
            self.lm.abandon(batch, state)
        return [s.row for s in gone]

    def plan(self, decoding: int) -> list[tuple[Row, bool, bool, int]]:
        """This turn's sequences, oldest first, as (row, starts now, completes now, prompt tokens the prefix
        cache gave it); ``run`` runs them. The prompts of this turn are looked up in the cache first (a hit
        shortens what is left, which may let more prompts into the turn)."""
        while True:
            counts = plan_chunks([s.remaining for s in self._states], self.budget, decoding, self.together)
            fresh = [s for s, _ in zip(self._states, counts) if not s.looked_up]
            if not fresh:
                break
            for state in fresh:
                state.looked_up = True
                if self.cache is not None:
                    tokens, kv = self.cache.lookup(state.prompt)
                    if tokens:
                        state.start_from(tokens, kv)  # under the names of this batch's layout (_remember)
        return [(s.row, not s.started, n == s.remaining, s.cached) for s, n in zip(self._states, counts)]

    def run(self, batch: KvBatch, decoding: int, on_joined: Joined) -> list[tuple[list, Exception]]:
        """Run this turn (``plan(decoding)``). Each prompt (or batched group) that completes joins ``batch``
        at its end, and ``on_joined(first, logits)`` hears of it at once (its rows are ``batch.rows[first:]``,
        their last logits [n, V]), before the next one runs. Returns each group of rows that failed (what
        they held is freed)."""
        counts = plan_chunks([s.remaining for s in self._states], self.budget, decoding, self.together)
        turn = list(zip(self._states, counts))  # they stay in the queue (and in ``load``) while they run
        # Only the oldest can be part-way through, and only the youngest can stop part-way: the
        # part-way one goes first (its reserved slot is the next one), then the whole prompts, then the
        # youngest takes its first chunk (reserving the slot after them).
        head = [turn.pop(0)] if turn and turn[0][0].started else []
        tail = [turn.pop()] if turn and turn[-1][1] < turn[-1][0].remaining else []
        failed: list[tuple[list, Exception]] = []
        for state, n in head:
            self._chunk(batch, state, n, on_joined, failed)
        hits = [(s, n) for s, n in turn if s.cached]  # they start after their cached prefix, in one chunk
        turn = [(s, n) for s, n in turn if not s.cached]
        together = self.together and isinstance(batch, DecodeBatch)  # slots prefill one by one anyway
        for group in [turn] if together and turn else [[x] for x in turn]:
            rows = [s.row for s, _ in group]
            first = len(batch)
            try:
                logits = self.lm.join(batch, rows, [s.prompt for s, _ in group], [s.reach for s, _ in group])
            except Exception as exc:
                failed.append((rows, exc))
                logits = None
            for state, _ in group:
                self._states.remove(state)
            if logits is not None:
                self._remember(batch, first, [s.prompt for s, _ in group])
                on_joined(first, logits)
        for state, n in hits + tail:
            self._chunk(batch, state, n, on_joined, failed)
        return failed

    def _remember(self, batch: KvBatch, first: int, prompts: Sequence[Sequence[int]]) -> None:
        """Keep the KV of the prompts that just joined as rows ``first…`` in the prefix cache. Before their
        first tokens are handed on: a row that finishes with its first token leaves the batch at once."""
        if self.cache is None or not isinstance(batch, DecodeBatch | SlotCache):
            return
        for i, prompt in enumerate(prompts, start=first):
            self.cache.store(prompt, batch.row_kv(i, len(prompt)))

    def _chunk(
        self,
        batch: KvBatch,
        state: ChunkedPrefill[Row],
        n: int,
        on_joined: Joined,
        failed: list[tuple[list, Exception]],
    ) -> None:
        first = len(batch)
        try:
            out = self.lm.prefill_chunk(batch, state, n)
        except Exception as exc:
            self.lm.abandon(batch, state)  # prefill_chunk frees it too; a failure before it ran must as well
            self._states.remove(state)
            failed.append(([state.row], exc))
            return
        if out is not None:  # its last chunk: it joined the batch
            self._states.remove(state)
            self._remember(batch, first, [state.prompt])
            on_joined(first, out)
