"""A prefix KV cache: the keys and values of prompts already prefilled, reused by prompts that start the same.

Prompts are matched a block of ``block_tokens`` tokens at a time, as vLLM's automatic prefix caching does:
a block's key is its tokens together with the identity of the block before it (a hash chain), so a block
matches only where every token before it matched too. The key holds the tokens themselves and a parent id
that is never reused, not a digest of them, so two prompts never share a block by a hash collision.

Guarantees:

- **Exact reuse.** A hit hands out the keys and values that the prefill of the very same tokens at the very
  same positions produced; the rest of the prompt is prefilled after them (``ChunkedPrefill`` starting at
  ``done`` = the cached tokens). At least the prompt's last token is always left to prefill: its logits
  give the first generated token.
- **Copy on hit.** ``lookup`` returns a copy of the matched KV (the sequence's own cache), so no running
  request ever reads the cache's memory, and evicting any block at any time is safe: no reference counts.
- **Bounded memory.** ``bytes`` (the stored blocks' KV) never exceeds ``max_bytes``: storing evicts the
  least recently used blocks first, a chain's last blocks before its first (a lookup touches a chain from its
  end to its start), and a block that goes takes the blocks after it along (nothing could reach them).
- **One model.** A cache belongs to one loaded model (one scheduler): keys carry no model name because
  no other model's KV ever reaches it.

Not thread-safe: the scheduler's device thread is its only user; ``stats`` may be read from any thread (a
snapshot of plain integers).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_BLOCK_TOKENS = 16
_ROOT = 0  # the parent id of a prompt's first block


@dataclass(frozen=True, slots=True)
class PrefixStats:
    """Counters of one prefix cache since it was made (``bytes``, ``blocks``: now)."""

    lookups: int = 0
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found in the cache
    stored_blocks: int = 0
    evictions: int = 0  # blocks evicted
    bytes: int = 0
    blocks: int = 0
    max_bytes: int = 0


class _Block:
    __slots__ = ("children", "id", "key", "kv", "nbytes")

    def __init__(self, key: tuple[int, tuple[int, ...]], block_id: int, kv: dict[str, np.ndarray]) -> None:
        self.key, self.id, self.kv = key, block_id, kv
        self.nbytes = sum(a.nbytes for a in kv.values())
        self.children: set[tuple[int, tuple[int, ...]]] = set()


class PrefixCache:
    """Blocks of prompt KV keyed by hash chains, LRU-evicted within ``max_bytes`` (see the module doc).

    KV arrays are per cache tensor name (whatever names the model's layout uses), each [H, tokens, D]."""

    def __init__(self, max_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        self.max_bytes, self.block_tokens = int(max_bytes), int(block_tokens)
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # LRU first
        self._ids = itertools.count(1)
        self.bytes = 0
        self._lookups = self._lookup_tokens = self._hit_tokens = self._stored = self._evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def stats(self) -> PrefixStats:
        return PrefixStats(
            self._lookups,
            self._lookup_tokens,
            self._hit_tokens,
            self._stored,
            self._evictions,
            self.bytes,
            len(self._blocks),
            self.max_bytes,
        )

    def _chain(self, prompt: Sequence[int], limit: int) -> list[_Block]:
        """The stored blocks that match ``prompt``'s first whole blocks, at most ``limit`` tokens of them."""
        size, found, parent = self.block_tokens, [], _ROOT
        for start in range(0, limit - size + 1, size):
            block = self._blocks.get((parent, tuple(prompt[start : start + size])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        return found

    def _touch(self, chain: Sequence[_Block]) -> None:
        for block in reversed(chain):  # the chain's start ends most recent: its end is evicted first
            self._blocks.move_to_end(block.key)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, dict[str, np.ndarray]]:
        """The longest cached prefix of ``prompt`` in whole blocks, leaving at least its last token: (tokens,
        a copy of their KV per name, [1, H, tokens, D]); (0, {}) on a miss."""
        self._lookups += 1
        self._lookup_tokens += len(prompt)
        chain = self._chain(prompt, len(prompt) - 1)
        if not chain:
            return 0, {}
        self._touch(chain)
        n = len(chain) * self.block_tokens
        self._hit_tokens += n
        names = chain[0].kv.keys()
        return n, {name: np.concatenate([b.kv[name] for b in chain], axis=1)[None] for name in names}

    def store(self, prompt: Sequence[int], kv: Mapping[str, np.ndarray]) -> int:
        """Keep the KV of ``prompt``'s whole blocks (``kv``: per name [H, >= those tokens, D], the prompt's
        cache from its first token); blocks already held are only touched. Returns the blocks added."""
        size = self.block_tokens
        whole = min(len(prompt), *(a.shape[1] for a in kv.values())) // size if kv else 0
        chain = self._chain(prompt, whole * size)
        added: list[_Block] = []
        parent = chain[-1].id if chain else _ROOT
        for start in range(len(chain) * size, whole * size, size):
            block = _Block(
                (parent, tuple(prompt[start : start + size])),
                next(self._ids),
                # a copy, always: ``kv`` may be a view of a KV buffer its row goes on writing (in-place slots),
                # and with one KV head a slice of it is already contiguous, which ascontiguousarray would not copy
                {name: np.array(a[:, start : start + size]) for name, a in kv.items()},
            )
            if block.nbytes > self.max_bytes:
                break
            self._make_room(block.nbytes, keep=chain + added)
            if self.bytes + block.nbytes > self.max_bytes:
                break  # the kept chain alone fills the cache: the rest of this prompt is not stored
            self._blocks[block.key] = block
            if parent != _ROOT:
                (chain + added)[-1].children.add(block.key)
            self.bytes += block.nbytes
            added.append(block)
            parent = block.id
        self._stored += len(added)
        self._touch(chain + added)
        return len(added)

    def _make_room(self, nbytes: int, keep: Sequence[_Block]) -> None:
        """Evict least recently used blocks (not those of ``keep``, the chain being stored) until ``nbytes`` fit."""
        kept = {b.key for b in keep}
        while self.bytes + nbytes > self.max_bytes:
            victim = next((k for k in self._blocks if k not in kept), None)
            if victim is None:
                return
            self._evict(victim)

    def _evict(self, key: tuple[int, tuple[int, ...]]) -> None:
        pending = [key]
        while pending:
            block = self._blocks.pop(pending.pop(), None)
            if block is None:
                continue
            self.bytes -= block.nbytes
            self._evictions += 1
            pending.extend(block.children)  # unreachable without their parent

    def clear(self) -> None:
        for key in list(self._blocks):
            self._evict(key)
