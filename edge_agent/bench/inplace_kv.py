"""Batch-1 decode of a plain export vs its in-place KV conversion vs onnxruntime-genai's generator.

    edge-agent bench inplace-kv [--model demo-phi3-small] [--rounds 5] [--tokens 64] [--genai DIR]

One process, the same prompts, the sides taking turns within each round (the first side alternates):

- ``plain``: the export as the daemon serves it without an engine (``DecoderLM``, a new present per step);
- ``inplace``: ``engines.inplace_kv.convert_inplace`` of it, served through ``DecoderLM``'s per-slot
  buffers that ONNX Runtime appends to in place (``SlotCache``, I/O binding), as the scheduler does;
- ``genai(converted)``: onnxruntime-genai's own generator on that converted folder, when installed;
- ``genai(builder)``: its generator on a folder its builder made (``scripts/make-genai-model``), when
  one is found (``--genai DIR`` or the ``<model>-genai`` sibling), else skipped with the reason.

Each side prefills a prompt (not timed), then decodes ``--tokens`` greedy tokens; its figure is the
median over rounds of tokens/s, and ratios are against ``plain`` measured in the same run. From code:
``format_report(run(opts), opts)`` with ``opts = InplaceKvOptions(...)`` (``bench/options.py``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..backends import SessionOptions
from ..config import default_cache_dir
from ..engines.inplace_kv import convert_inplace
from ..models.catalog import inspect_folder, resolve_model
from ..models.llm import DecoderLM
from .genai import GenaiRunner, find_genai_folder
from .options import InplaceKvOptions

Side = Callable[[Sequence[int], int], float]  # (prompt, tokens) -> seconds spent decoding


def serving_decode(lm: DecoderLM) -> Side:
    """Decode through the adapter's batch API (what the scheduler calls), one row."""

    def run(prompt: Sequence[int], tokens: int) -> float:
        batch = lm.new_batch(1)
        logits = lm.join(batch, [0], [list(prompt)], reach=[len(prompt) + tokens + 1])  # as the scheduler sizes it
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = lm.decode(batch, [int(np.argmax(logits[0]))])
        return time.perf_counter() - t0

    return run


def genai_decode(runner: GenaiRunner) -> Side:
    def run(prompt: Sequence[int], tokens: int) -> float:
        _, times = runner.generate(prompt, tokens + 1)
        return times[-1] - times[0]  # from the first generated token (the prefill's) to the last

    return run


def measure(sides: dict[str, Side], prompts: list[list[int]], rounds: int, tokens: int) -> dict[str, list[float]]:
    """tokens/s per side per round (all prompts of a round together)."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values():  # one untimed pass each: first-call allocations
        side(prompts[0], 4)
    for r in range(rounds):
        order = list(sides.items())
        for name, side in order[::-1] if r % 2 else order:
            spent = sum(side(p, tokens) for p in prompts)
            out[name].append(tokens * len(prompts) / spent)
    return out


def run(opts: InplaceKvOptions) -> dict:
    """Every side over ``rounds`` rounds on the same prompts; tokens/s per side and round, their medians,
    the sides skipped (with why) and the conversion's time and check."""
    src = resolve_model(opts.model, default_cache_dir() / "models")
    options = SessionOptions(threads=opts.threads)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        conv = convert_inplace(src.path, Path(tmp) / "inplace", threads=opts.threads)
        plain = DecoderLM.open(src, "onnxruntime", options)
        inplace = DecoderLM.open(inspect_folder(Path(tmp) / "inplace", name=src.name), "onnxruntime", options)
        vocab = min(1000, int(src.config.get("vocab_size", 1000)))
        prompts = [rng.integers(3, vocab, size=opts.prompt_tokens).tolist() for _ in range(opts.prompts)]
        sides: dict[str, Side] = {"plain": serving_decode(plain), "inplace": serving_decode(inplace)}
        skipped: dict[str, str] = {}
        builder_dir, why = find_genai_folder(src, opts.genai)
        for name, folder, reason in (
            ("genai(converted)", Path(tmp) / "inplace" if why is None or "installed" not in why else None, why),
            ("genai(builder)", builder_dir, why),
        ):
            if folder is None:
                skipped[name] = str(reason)
                continue
            sides[name] = genai_decode(GenaiRunner(folder, opts.threads))
        rates = measure(sides, prompts, opts.rounds, opts.tokens)
        plain.close()
        inplace.close()
    med = {name: float(np.median(v)) for name, v in rates.items()}
    return {"model": src.name, "median_tok_s": med, "rounds": rates, "skipped": skipped, "conversion": conv}


def format_report(report: dict, opts: InplaceKvOptions) -> str:
    med, rates, conv = report["median_tok_s"], report["rounds"], report["conversion"]
    lines = [
        f"{report['model']}: batch-1 greedy decode, {opts.prompts} prompts x {opts.tokens} tokens, {opts.rounds} "
        f"rounds, {opts.threads} thread(s); converted in {conv['convert_s']} s, check "
        f"{conv['check']['max_rel_diff']:.1e}",
        f"{'side':<18}{'tok/s (median)':>16}{'min-max':>18}{'vs plain':>10}",
    ]
    for name, v in rates.items():
        lines.append(f"{name:<18}{med[name]:>16.1f}{f'{min(v):.1f}-{max(v):.1f}':>18}{med[name] / med['plain']:>9.2f}x")
    for name, reason in report["skipped"].items():
        lines.append(f"{name:<18}skipped: {reason}")
    return "\n".join(lines)
