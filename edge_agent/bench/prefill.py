"""``edge-agent bench prefill``: chunked prefill on vs off, side by side in one run.

Each round, for each setting (whole prompts: ``prefill_chunk_tokens = 0``, and chunked: ``--chunk``,
in alternating order): ``--streams`` requests with short prompts decode; once each has its first
tokens, one request with a ``--long-prompt-tokens`` prompt arrives. Measured while it is admitted
(from its arrival until it finishes):

- **stream ITL**: the gaps between the running streams' tokens, p50 / p99 / max (a whole prefill
  shows as one gap as long as the prefill; chunked, a gap is at most one chunk plus a step);
- **long TTFT**: the long request's time to first token (chunking spreads its prefill over decode
  steps, so it grows by about those steps);
- **stream tok/s**: the streams' tokens per second over the same window.

Figures are medians over ``--rounds``; the ratios are chunked over whole. Greedy decoding, one model
loaded once, on the engine thread as served (``LLMScheduler``). From code:
``format_report(run(PrefillOptions(streams=2)))`` (``bench/options.py``).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..backends import SessionOptions
from ..errors import InputError
from ..metrics.window import percentile
from ..models.catalog import inspect_folder, resolve_model
from ..models.llm import DecoderLM
from ..models.sampling import SamplingParams
from ..serving.llm.handle import RequestHandle
from ..serving.llm.scheduler import Limits, LLMScheduler
from .options import PrefillOptions, as_json


def _collect(handle: RequestHandle, times: list[float]) -> None:
    for event in handle:
        times.append(event.time_s)


def one_run(lm: DecoderLM, chunk: int, streams: int, long_prompt: list[int], long_new: int, seed: int) -> dict:
    """One setting, one round: the figures of the docstring for the long request's admission window."""
    rng = np.random.default_rng(seed)
    hi = max(4, lm.tokenizer.vocab_size - 16)
    sched = LLMScheduler(lm, Limits(max_batch=streams + 1, batch_timeout_ms=0, prefill_chunk_tokens=chunk)).start()
    try:
        stream_tokens = lm.contract.max_context - 32
        handles = [
            sched.submit(
                rng.integers(3, hi, size=16).tolist(), SamplingParams(max_new_tokens=stream_tokens, ignore_eos=True)
            )
            for _ in range(streams)
        ]
        times: list[list[float]] = [[] for _ in handles]
        readers = [threading.Thread(target=_collect, args=(h, t), daemon=True) for h, t in zip(handles, times)]
        for reader in readers:
            reader.start()
        while min(len(t) for t in times) < 4:  # every stream is decoding
            time.sleep(0.002)
        start = time.monotonic()
        long_ = sched.submit(long_prompt, SamplingParams(max_new_tokens=long_new, ignore_eos=True))
        timing = long_.result(600).timing
        end = time.monotonic()
        for handle in handles:
            handle.cancel()
        for reader in readers:
            reader.join(60)
    finally:
        sched.stop()
    gaps = [(b - a) * 1e3 for t in times for a, b in itertools.pairwise(t) if start < b <= end]
    tokens = sum(1 for t in times for x in t if start < x <= end)
    return {
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "itl_max_ms": max(gaps, default=None),
        "long_ttft_ms": timing.ttft_ms,
        "stream_tok_s": tokens / (end - start),
    }


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(opts: PrefillOptions) -> dict:
    """Both settings over ``rounds`` alternating rounds on one model; the report (medians, ratios, rounds)."""
    if min(opts.streams, opts.chunk, opts.rounds, opts.long_prompt_tokens) < 1:
        raise InputError("--streams, --chunk, --rounds and --long-prompt-tokens must be at least 1")
    if opts.genai:
        ref = inspect_folder(Path(opts.genai))
        if ref.model_type != "genai":
            raise InputError(f"--genai {opts.genai}: no genai_config.json there")
    else:
        from ..config import load_settings

        cache = Path(opts.cache_dir) if opts.cache_dir else load_settings(None).models.cache_dir
        ref = resolve_model(opts.model, cache)
    lm = DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=opts.threads))
    try:
        if opts.long_prompt_tokens + opts.long_new_tokens > lm.contract.max_context:
            raise InputError(f"--long-prompt-tokens: the model's context is {lm.contract.max_context} tokens")
        hi = max(4, lm.tokenizer.vocab_size - 16)
        long_prompt = np.random.default_rng(0).integers(3, hi, size=opts.long_prompt_tokens).tolist()
        list(lm.generate_greedy(long_prompt, 2))  # warm the long shapes once
        settings = {"whole": 0, "chunked": opts.chunk}
        rounds: dict[str, list[dict]] = {name: [] for name in settings}
        for r in range(opts.rounds):
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for name in order:
                rounds[name].append(one_run(lm, settings[name], opts.streams, long_prompt, opts.long_new_tokens, r))
                print(f"round {r + 1}/{opts.rounds} {name}: {rounds[name][-1]}", file=sys.stderr)
    finally:
        lm.close()
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_ms", "stream_tok_s")
    medians = {name: {k: _median(rows, k) for k in keys} for name, rows in rounds.items()}
    ratios = {k: _ratio(medians["chunked"][k], medians["whole"][k]) for k in keys}
    return {"model": ref.name, "config": as_json(opts), "medians": medians, "ratios": ratios, "rounds": rounds}


def format_report(report: dict) -> str:
    c = report["config"]
    lines = [
        f"{report['model']}: {c['streams']} streams decoding, one {c['long_prompt_tokens']}-token prompt arrives; "
        f"chunk {c['chunk']} vs whole; medians of {c['rounds']} rounds",
        f"{'':14}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}{'long TTFT ms':>14}{'stream tok/s':>14}",
    ]
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_ms", "stream_tok_s")
    widths = (12, 12, 12, 14, 14)
    for name, row in [*report["medians"].items(), ("chunked/whole", report["ratios"])]:
        cells = "".join(
            f"{'-':>{w}}" if row[k] is None else f"{row[k]:>{w}.{3 if name == 'chunked/whole' else 1}f}"
            for k, w in zip(keys, widths)
        )
        lines.append(f"{name:14}{cells}")
    return "\n".join(lines)
