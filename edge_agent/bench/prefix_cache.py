"""``edge-agent bench prefix-cache``: TTFT of a request whose long system prompt was seen before
against one whose system prompt is new, side by side in one run.

Each round makes two system prompts of ``--system-tokens`` tokens (chat text, tokenized by the model's
tokenizer) that share nothing: the first is sent once with a question (it enters the prefix cache), then
both are sent with another question, in alternating order. Reported, medians over ``--rounds``: each
request's TTFT and the ``cached_tokens`` it reports, and the ratio seen / fresh. One model, loaded once,
served as the daemon serves it (``LLMScheduler``, its default limits, the prefix cache on); ``--inplace``
also measures the in-place KV layout (the plain export converted, as the daemon's background build does).
From code: ``format_report(run(PrefixCacheOptions(inplace=True)))`` (``bench/options.py``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..backends import SessionOptions
from ..errors import InputError
from ..models.catalog import ModelRef, inspect_folder, resolve_model
from ..models.llm import DecoderLM
from ..models.sampling import SamplingParams
from ..models.tokenizer import Message
from ..serving.llm.scheduler import Limits, LLMScheduler
from .options import PrefixCacheOptions, as_json

_WORDS = (
    "kitchen light sensor morning evening garden door window heating schedule weather forecast music volume "
    "timer alarm reminder shopping list calendar meeting battery charger camera motion alert garage thermostat "
    "humidity fan vacuum robot energy solar panel washing machine dryer oven fridge freezer coffee kettle"
).split()


def system_prompt(lm: DecoderLM, tokens: int, seed: int) -> str:
    """An assistant's instructions of at least ``tokens`` tokens, different for every ``seed``."""
    rng = np.random.default_rng(seed)
    lines = [f"You are home assistant number {seed}. Follow these house rules exactly."]
    while len(lm.tokenizer.encode("\n".join(lines))) < tokens:
        words = " ".join(rng.choice(_WORDS, size=12))
        lines.append(f"Rule {len(lines)}: when asked about the {words}, answer briefly and politely.")
    return "\n".join(lines)


def _prompt(lm: DecoderLM, system: str, question: str) -> list[int]:
    return lm.tokenizer.encode_chat([Message("system", system), Message("user", question)])


def measure(lm: DecoderLM, opts: PrefixCacheOptions) -> dict:
    """The rounds on one model: per round, the seen and the fresh request's TTFT and cached tokens."""
    limits = Limits(batch_timeout_ms=0, prefix_cache_mb=opts.max_mb)
    sched = LLMScheduler(lm, limits).start()
    params = SamplingParams(max_new_tokens=opts.new_tokens, ignore_eos=True)
    rows: dict[str, list[dict]] = {"seen": [], "fresh": []}
    try:
        sched.submit(_prompt(lm, system_prompt(lm, opts.system_tokens, 10_000), "Hello?"), params).result(600)  # warm
        for r in range(opts.rounds):
            seen, fresh = (system_prompt(lm, opts.system_tokens, 2 * r + k) for k in (1, 2))
            sched.submit(_prompt(lm, seen, "Is the garage door closed?"), params).result(600)
            prompts = {
                name: _prompt(lm, text, "Turn on the kitchen light.")
                for name, text in (("seen", seen), ("fresh", fresh))
            }
            for name in ("seen", "fresh") if r % 2 == 0 else ("fresh", "seen"):
                timing = sched.submit(prompts[name], params).result(600).timing
                rows[name].append(
                    {
                        "ttft_ms": timing.ttft_ms,
                        "cached_tokens": timing.cached_tokens,
                        "prompt_tokens": timing.tokens_in,
                    }
                )
                print(f"round {r + 1}/{opts.rounds} {name}: {rows[name][-1]}", file=sys.stderr)
    finally:
        sched.stop()
    stats = sched.prefix_stats
    medians = {name: {k: statistics.median(x[k] for x in got) for k in got[0]} for name, got in rows.items()}
    ratio = medians["seen"]["ttft_ms"] / medians["fresh"]["ttft_ms"]
    return {"medians": medians, "ttft_ratio": ratio, "rounds": rows, "stats": asdict(stats) if stats else None}


def _open(ref: ModelRef, threads: int) -> DecoderLM:
    return DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=threads))


def run(opts: PrefixCacheOptions) -> dict:
    """The rounds on the plain export (and, with ``inplace``, its in-place KV conversion); the report."""
    if min(opts.rounds, opts.system_tokens, opts.new_tokens) < 1:
        raise InputError("--rounds, --system-tokens and --new-tokens must be at least 1")
    from ..config import load_settings

    cache = Path(opts.cache_dir) if opts.cache_dir else load_settings(None).models.cache_dir
    ref = resolve_model(opts.model, cache)
    layouts: dict[str, dict] = {}
    lm = _open(ref, opts.threads)
    try:
        if opts.system_tokens + 64 + opts.new_tokens > lm.contract.max_context:
            raise InputError(f"--system-tokens: the model's context is {lm.contract.max_context} tokens")
        layouts["plain"] = measure(lm, opts)
    finally:
        lm.close()
    if opts.inplace:
        from ..engines.inplace_kv import convert_inplace

        with tempfile.TemporaryDirectory() as tmp:
            convert_inplace(ref.path, Path(tmp) / "inplace", check_tokens=0)
            lm = _open(inspect_folder(Path(tmp) / "inplace", name=ref.name), opts.threads)
            try:
                layouts["inplace"] = measure(lm, opts)
            finally:
                lm.close()
    return {"model": ref.name, "config": as_json(opts), "layouts": layouts}


def format_report(report: dict) -> str:
    c = report["config"]
    lines = [
        f"{report['model']}: a {c['system_tokens']}-token system prompt seen before vs a fresh one of the same "
        f"length; medians of {c['rounds']} rounds",
        f"{'layout':10}{'request':8}{'TTFT ms':>10}{'cached':>8}{'prompt':>8}",
    ]
    for layout, got in report["layouts"].items():
        for name, row in got["medians"].items():
            lines.append(
                f"{layout:10}{name:8}{row['ttft_ms']:>10.1f}{row['cached_tokens']:>8.0f}{row['prompt_tokens']:>8.0f}"
            )
        lines.append(f"{layout:10}{'seen/fresh TTFT':18}{got['ttft_ratio']:>8.3f}")
    return "\n".join(lines)
