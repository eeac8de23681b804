"""When waiting LLM requests start: the scheduler's limits, its pure admission decision, and which
requests go ahead of the queue (``INTERACTIVE``).

``plan_admission`` takes the clock as an argument (tests drive it with a fake one): with sequences
already running, newcomers join at the next step boundary; on an idle engine an incomplete batch
waits for a batch-mate only as long as ``batch_wait.AdaptiveWait`` says one is worth waiting for,
never longer than ``batch_timeout_ms``. A sequence whose prompt is still being prefilled in chunks
counts as running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..batch_wait import AdaptiveWait

# A request a person is waiting on while they speak (the voice turn's reply and its prefill ahead): it
# joins the queue ahead of every waiting request without this tag, behind those with it.
INTERACTIVE = "interactive"


@dataclass(frozen=True, slots=True)
class Limits:
    """Batching and admission limits of one scheduler (``plan_admission`` reads them)."""

    max_batch: int = 4
    batch_timeout_ms: float = 80.0
    preferred_batch_sizes: tuple[int, ...] = (2, 4)
    max_queue: int = 64
    queue_timeout_ms: float = 30_000.0
    adaptive: bool = True  # wait only for an expected batch-mate (AdaptiveWait); False: the fixed timeout
    sla_ms: float = 387.0  # the TTFT the adaptive wait must leave room for (the LLM SLA's target)
    prefill_chunk_tokens: int = 256  # prompt tokens prefilled per turn while others decode (0: whole prompts)
    prefill_together: bool = False  # whole prompts of one turn in one batched prefill (else one by one)
    prefix_cache_mb: float = 256.0  # the prefix KV cache's bound (0: no prefix cache; models.prefix_cache)
    prefix_block_tokens: int = 16  # tokens per block the prefix cache matches prompts by
    jump_forward: bool = True  # an output format's forced tokens go in with the picked one, in one step
    voice_alone: bool = True  # a voice turn's rows decode without the chats' (a CPU: a batch costs per row)


def plan_admission(
    waiting_since: Sequence[float], running: int, now: float, limits: Limits, wait: AdaptiveWait | None = None
) -> tuple[int, float | None]:
    """How many of the oldest waiting requests to prefill now, and, if none, when to look again.

    ``waiting_since``: admission times of the queued requests, oldest first. Without ``wait`` an
    incomplete batch on an idle engine waits ``batch_timeout_ms``; with it, only as long as
    ``wait.wait_s`` says a batch-mate is worth waiting for (still bounded by the timeout).
    """
    free = limits.max_batch - running
    if not waiting_since or free <= 0:
        return 0, None
    n = min(free, len(waiting_since))
    if running > 0 or n == free or n in limits.preferred_batch_sizes:
        return n, None
    due = waiting_since[0] + limits.batch_timeout_ms / 1e3
    if wait is not None:
        hold = wait.wait_s(now, waiting_since[0], free - n)
        due = min(due, now + hold) if hold > 0 else now
    return (n, None) if now >= due else (0, due)
