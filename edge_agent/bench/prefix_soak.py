"""``edge-agent bench prefix-soak``: the prefix cache over a long run, memory first.

``--requests`` requests (2,000 by default) are served one after another by one scheduler with the prefix
cache on, their system prompts rotating over ``--prompts`` distinct ones, more than the cache can hold
(``--max-mb``), so it hits, stores and evicts all the way through. Every ``--every`` requests the process's
resident memory and the cache's bytes are sampled. Reported: the cache's largest size against its bound,
the resident memory of the first sample after the warm-up against the last and the largest (flat means
bounded), and the cache's hits and evictions. From code: ``format_report(soak(PrefixSoakOptions()))``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError
from ..models.catalog import resolve_model
from ..models.sampling import SamplingParams
from ..progress import Progress
from ..serving.llm.scheduler import Limits, LLMScheduler
from .options import PrefixSoakOptions
from .prefix_cache import _open, _prompt, system_prompt


def rss_mb() -> float:
    """This process's resident memory (Linux ``/proc/self/statm``), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def soak(opts: PrefixSoakOptions, show: bool = True) -> dict:
    """Serve the rotating prompts and sample memory (see the module doc); ``show``: a progress line on stderr."""
    if min(opts.requests, opts.prompts, opts.system_tokens, opts.new_tokens, opts.every) < 1 or opts.max_mb <= 0:
        raise InputError("the counts must be at least 1 and --max-mb above 0")
    from ..config import load_settings

    cache = Path(opts.cache_dir) if opts.cache_dir else load_settings(None).models.cache_dir
    ref = resolve_model(opts.model, cache)
    lm = _open(ref, opts.threads)
    prompts = [_prompt(lm, system_prompt(lm, opts.system_tokens, seed), "What now?") for seed in range(opts.prompts)]
    sched = LLMScheduler(lm, Limits(batch_timeout_ms=0, prefix_cache_mb=opts.max_mb)).start()
    params = SamplingParams(max_new_tokens=opts.new_tokens, ignore_eos=True)
    samples: list[dict] = []
    cached = 0
    try:
        with Progress("prefix cache soak", "requests", enabled=show) as bar:
            for i in range(opts.requests):
                done = sched.submit(prompts[i % len(prompts)], params).result(600)
                cached += done.timing.cached_tokens or 0
                if (i + 1) % opts.every == 0 or i + 1 == opts.requests:
                    now = sched.prefix_stats
                    held = now.bytes if now is not None else 0
                    samples.append({"requests": i + 1, "rss_mb": round(rss_mb(), 1), "cache_bytes": held})
                bar.update(i + 1, opts.requests)
        stats = sched.prefix_stats
    finally:
        sched.stop()
        lm.close()
    after_warmup = samples[1:] or samples
    return {
        "model": ref.name,
        "requests": opts.requests,
        "distinct_prompts": opts.prompts,
        "prompt_tokens": len(prompts[0]),
        "max_mb": opts.max_mb,
        "cache_bytes_max": max(s["cache_bytes"] for s in samples),
        "cache_bound_bytes": int(opts.max_mb * (1 << 20)),
        "rss_mb": {
            "first": after_warmup[0]["rss_mb"],
            "last": after_warmup[-1]["rss_mb"],
            "max": max(s["rss_mb"] for s in after_warmup),
        },
        "hit_tokens": stats.hit_tokens if stats else 0,
        "cached_tokens_reported": cached,
        "evicted_blocks": stats.evictions if stats else 0,
        "samples": samples,
    }


def format_report(r: dict) -> str:
    rss = r["rss_mb"]
    return "\n".join(
        [
            f"prefix cache soak: {r['requests']} requests of {r['prompt_tokens']} tokens over {r['distinct_prompts']} "
            f"system prompts, {r['model']}, bound {r['max_mb']:g} MiB",
            f"  cache bytes: largest {r['cache_bytes_max']:,} of {r['cache_bound_bytes']:,} allowed",
            f"  resident memory: {rss['first']} MiB after the first {r['samples'][0]['requests']} requests, "
            f"{rss['last']} MiB at the end, {rss['max']} MiB at most",
            f"  hit tokens {r['hit_tokens']:,} (reported per request: {r['cached_tokens_reported']:,}), "
            f"evicted blocks {r['evicted_blocks']:,}",
        ]
    )
