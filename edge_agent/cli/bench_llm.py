"""``edge-agent bench llm``, ``bench tiers``, ``bench grammar``, ``bench prefill``, ``bench prefix-cache`` and
``bench prefix-soak``: the flags of the LLM workloads, parsed into their options (``bench/options.py``) and
handed to the workload's ``run``. The last three return a report: the command prints it, and writes it with
``--json``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..bench.grammar import EOS_CANDIDATES
from ..bench.grammar_docs import SCHEMAS
from ..bench.grammar_engines import ENGINES
from ..bench.options import (
    GrammarOptions,
    LLMOptions,
    PrefillOptions,
    PrefixCacheOptions,
    PrefixSoakOptions,
    TiersOptions,
    from_mapping,
)


# Long on purpose: one flag per statement, read as the list of bench llm's flags.
def add_llm(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "llm",
        help="benchmark LLM serving: agent vs a bare runtime loop, with a bandwidth roofline",
        description="Run synthetic requests through the agent's scheduler and through a bare sequential "
        "runtime loop (alternating rounds), report TTFT/ITL/TPOT/E2E percentiles, tokens/s, "
        "goodput, overhead ratios and the memory-bandwidth roofline.",
    )
    p.add_argument(
        "--config", metavar="FILE", default=None, help="the daemon's config (default: installed, else embedded)"
    )
    p.add_argument("--tier", default=None, help="the configured LLM tier to measure (default: the top one)")
    p.add_argument("--model", default=None, help="another model (demo name or folder) on that tier's settings")
    p.add_argument("--backend", default=None, choices=("onnxruntime", "openvino"), help="default: the tier's")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: device.threads, as served)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="C",
        help="closed-loop clients (default 1); batch limits: the daemon's",
    )
    p.add_argument("--requests", type=int, default=16, metavar="N", help="requests per round (default 16)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="R",
        help="Poisson arrivals at R requests/s (seeded); default: closed loop with C clients",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="P", help="synthetic prompt length (default 128)")
    p.add_argument(
        "--max-new-tokens", type=int, default=128, metavar="T", help="tokens per request, EOS ignored (default 128)"
    )
    p.add_argument(
        "--sla-ms",
        type=float,
        default=None,
        help="goodput counts requests with ttft_ms <= this (default: the config's sla.target_ms, 387)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating agent/baseline rounds; medians reported (default 3)"
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw TTFT/ITL distributions and tokens/s to PNG")
    p.add_argument("--no-baseline", action="store_true", help="skip the bare-loop baseline")
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="keep the tier's prefix KV cache on (off by default: every round sends the same prompts, and the "
        "peers have none)",
    )
    p.add_argument(
        "--genai",
        metavar="DIR",
        default=None,
        help="onnxruntime-genai folder of the same model to compare with (default: MODEL-genai next to "
        "the model if present; 'none' to skip)",
    )
    p.add_argument(
        "--ov-genai",
        metavar="DIR",
        default=None,
        help="openvino-genai's NPU pipeline on a stateful IR folder, beside an NPU tier ('auto', the default "
        "on an NPU tier: the IR the tier serves; 'none' to skip)",
    )
    p.add_argument(
        "--ramp-s",
        type=float,
        default=None,
        metavar="S",
        help="closed loop: client k starts at k·S/C (default: one measured request's e2e when C > 1, "
        "so clients do not arrive in lockstep; 0 = all at once)",
    )
    p.add_argument(
        "--scaling",
        type=int,
        default=None,
        metavar="K",
        help="also run concurrency K in the same rounds and report K's tokens/s and TTFT P99 as ratios "
        "to C's (e.g. --concurrency 1 --scaling 4)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: the configured models cache)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_llm)
    return p


def _llm(args: argparse.Namespace) -> int:
    from ..bench import llm

    return llm.run(from_mapping(LLMOptions, vars(args)))


def add_tiers(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tiers",
        help="rising/holding/falling load: tier controller vs a fixed top tier",
        description="``edge-agent bench tiers``: a rising, holding and falling Poisson load on a tier ladder, "
        "adaptive vs. fixed.",
    )
    p.add_argument(
        "--workload",
        choices=("llm", "asr"),
        default="llm",
        help="llm: the LLM ladder on chat requests (default); asr: the ASR ladder on real-time "
        "spoken-command streams (bench/tiers_asr.py)",
    )
    p.add_argument(
        "--tiers",
        default=None,
        help="model ladder, heaviest first (comma separated; default "
        "demo-phi3-small,demo-phi3 for llm, demo-whisper,demo-asr for asr)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=None, help="seconds per run (default 60 for llm, 35 for asr)")
    p.add_argument(
        "--base-rate",
        type=float,
        default=None,
        help="requests/s at the start and end (default: the top "
        "tier's single-request rate, 1 / its e2e alone; asr: 0.3 streams/s)",
    )
    p.add_argument(
        "--peak-rate",
        type=float,
        default=None,
        help="requests/s at the peak (default: 5 × that rate, "
        "beyond what batching lets the top tier serve; asr: 1.5 streams/s)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument(
        "--target-ms",
        type=float,
        default=None,
        help="P95 target: TTFT for llm (default 387, the agent's "
        "SLA), first_partial_ms for asr (default [sla.asr] target_ms, 300)",
    )
    p.add_argument("--window-s", type=float, default=6.0)
    p.add_argument("--evaluate-every-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", dest="json_out", metavar="OUT")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_tiers)
    return p


def _tiers(args: argparse.Namespace) -> int:
    from ..bench import tiers

    return tiers.run(from_mapping(TiersOptions, vars(args)))


def add_grammar(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "grammar",
        help="grammar engines for structured output: compile and per-token mask times, side by side",
        description="Compile a tool-call JSON schema and json_object with llguidance, outlines-core and "
        "xgrammar, walk schema-valid documents token by token at batch 1 and 4, checking every mask, and "
        "report medians over rounds with each engine's ratio to llguidance.",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds over all engines; medians reported (default 3)")
    p.add_argument("--tokens", type=int, default=400, help="mask steps per batch row per walk, at least (default 400)")
    p.add_argument("--batch", type=int, default=4, help="rows stepping together in the batched walk (default 4)")
    p.add_argument(
        "--threads",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="threads for llguidance's batch executor and xgrammar's compiler (default min(4, CPUs))",
    )
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset (default all)")
    p.add_argument("--grammars", default=",".join(SCHEMAS), help="comma-separated subset (default all)")
    p.add_argument(
        "--tokenizer", type=Path, metavar="PATH", help="a tokenizer.json (default: the trained 32k Phi-3-style one)"
    )
    p.add_argument("--eos", help=f"EOS token text (default: the first found of {', '.join(EOS_CANDIDATES)})")
    p.add_argument(
        "--n-logits", type=int, help="the model's logit count (default 32064, or the vocabulary rounded up to 64)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated documents (default 0)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="bar charts of compile and mask times (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_grammar)
    return p


def _grammar(args: argparse.Namespace) -> int:
    from ..bench import grammar

    return grammar.main(from_mapping(GrammarOptions, vars(args)))


def _write_report(report: dict, out: str | None) -> None:
    """``--json OUT``: the report as JSON in OUT."""
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


def add_prefill(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prefill",
        help="chunked prefill on vs off: running streams' ITL while a long prompt arrives",
        description="Chunked prefill on vs off, side by side in one run.",
    )
    p.add_argument("--model", default="demo-phi3-small", help="demo name or model folder (default demo-phi3-small)")
    p.add_argument("--genai", default=None, metavar="DIR", help="an onnxruntime-genai folder instead (in-place KV)")
    p.add_argument("--cache-dir", default=None, help="where demo models are generated (default: [models] cache_dir)")
    p.add_argument("--streams", type=int, default=3, help="running streams (default 3)")
    p.add_argument("--long-prompt-tokens", type=int, default=1024, help="the long prompt (default 1024 tokens)")
    p.add_argument("--long-new-tokens", type=int, default=8, help="tokens the long request generates (default 8)")
    p.add_argument("--chunk", type=int, default=256, help="prefill_chunk_tokens when chunked (default 256)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; medians are reported (default 5)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="also write the report as JSON")
    p.set_defaults(func=_prefill)
    return p


def _prefill(args: argparse.Namespace) -> int:
    from ..bench import prefill

    report = prefill.run(from_mapping(PrefillOptions, vars(args)))
    print(prefill.format_report(report))
    _write_report(report, args.json_out)
    return 0


def add_prefix_cache(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prefix-cache",
        help="TTFT of a long system prompt seen before vs a fresh one (the prefix cache)",
        description="TTFT of a request whose long system prompt was seen before against one whose system "
        "prompt is new, side by side in one run.",
    )
    p.add_argument("--model", default="demo-phi3-small", help="demo name or model folder (default demo-phi3-small)")
    p.add_argument("--cache-dir", default=None, help="where demo models are generated (default: [models] cache_dir)")
    p.add_argument("--system-tokens", type=int, default=1600, help="system prompt length (default 1600 tokens)")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens each request generates (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; medians are reported (default 5)")
    p.add_argument("--max-mb", type=float, default=256.0, help="the prefix cache's bound (default 256 MiB)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--inplace", action="store_true", help="also the in-place KV layout (the export converted)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="also write the report as JSON")
    p.set_defaults(func=_prefix_cache)
    return p


def _prefix_cache(args: argparse.Namespace) -> int:
    from ..bench import prefix_cache

    report = prefix_cache.run(from_mapping(PrefixCacheOptions, vars(args)))
    print(prefix_cache.format_report(report))
    _write_report(report, args.json_out)
    return 0


def add_prefix_soak(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prefix-soak",
        help="the prefix cache over a long run of rotating system prompts: its bound and resident memory",
        description="The prefix cache over a long run, memory first. --requests requests (2,000 by default) are "
        "served one after another by one scheduler with the prefix cache on, their system prompts rotating over "
        "--prompts distinct ones, more than the cache can hold (--max-mb), so it hits, stores and evicts all the "
        "way through. Every --every requests the process's resident memory and the cache's bytes are sampled. "
        "Reported: the cache's largest size against its bound, the resident memory of the first sample after "
        "the warm-up against the last and the largest (flat means bounded), and the cache's hits and evictions.",
    )
    p.add_argument("--model", default="demo-phi3", help="demo name or model folder (default demo-phi3)")
    p.add_argument("--cache-dir", default=None, help="where demo models are generated")
    p.add_argument("--requests", type=int, default=2000, help="requests in all (default 2000)")
    p.add_argument("--prompts", type=int, default=40, help="distinct system prompts, rotating (default 40)")
    p.add_argument("--system-tokens", type=int, default=400, help="system prompt length (default 400 tokens)")
    p.add_argument("--new-tokens", type=int, default=2, help="tokens each request generates (default 2)")
    p.add_argument("--max-mb", type=float, default=4.0, help="the prefix cache's bound (default 4 MiB)")
    p.add_argument("--every", type=int, default=100, help="sample memory every N requests (default 100)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="also write the report as JSON")
    p.set_defaults(func=_prefix_soak)
    return p


def _prefix_soak(args: argparse.Namespace) -> int:
    from ..bench import prefix_soak

    report = prefix_soak.soak(from_mapping(PrefixSoakOptions, vars(args)), show=sys.stderr.isatty())
    print(prefix_soak.format_report(report))
    _write_report(report, args.json_out)
    return 0
