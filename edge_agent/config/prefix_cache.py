"""``[prefix_cache]``: the LLM schedulers' prefix KV cache (``models.prefix_cache``): prompts that start as an
earlier one did take that start's keys and values instead of prefilling it again (a long system prompt, a
conversation's earlier turns). On by default on the CPU layouts; a stateful NPU tier runs without it."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class PrefixCacheConfig(Section):
    """``[prefix_cache]``: whether each LLM tier keeps a prefix KV cache, its memory bound and its block size."""

    enabled: bool = Field(
        True,
        description="reuse the KV of prompt prefixes already prefilled (greedy tokens are the same either way); "
        "tiers whose runtime keeps the KV itself (the NPU's LLM mode) run without it",
    )
    max_mb: float = Field(
        256.0,
        gt=0,
        le=1024 * 1024,
        description="the most memory each tier's cache holds, in MiB; least recently used blocks are evicted first; "
        "at least one block of each tier's model (check-config and the start refuse less)",
    )
    block_tokens: int = Field(
        16,
        ge=1,
        le=1024,
        description="prompts are matched this many tokens at a time (a prefix is reused in whole blocks)",
    )

    @property
    def limit_mb(self) -> float:
        """The bound a scheduler takes (``Limits.prefix_cache_mb``): 0 when the cache is off."""
        return self.max_mb if self.enabled else 0.0
