"""``edge-agent bench``: benchmarks that print figures measured side by side. The workloads live in
``edge_agent/bench/`` and take their options as dataclasses (``bench/options.py``); their flags are parsed
here, one module per family: ``bench_llm.py`` (llm, tiers, grammar, prefill, prefix-cache, prefix-soak),
``bench_speech.py`` (asr, voice, calls), ``bench_daemon.py`` (telemetry, fleet, serve, overload) and
``bench_engines.py`` (weight-only, inplace-kv)."""

from __future__ import annotations

import argparse

from . import bench_daemon, bench_engines, bench_llm, bench_speech


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures measured side by side")
    bsub = p.add_subparsers(dest="bench_command", metavar="WORKLOAD", required=True)
    bench_llm.add_llm(bsub)
    bench_llm.add_tiers(bsub)
    bench_speech.add_asr(bsub)
    bench_daemon.add_telemetry(bsub)
    bench_daemon.add_fleet(bsub)
    bench_daemon.add_serve(bsub)
    bench_llm.add_grammar(bsub)
    bench_speech.add_voice(bsub)
    bench_speech.add_calls(bsub)
    bench_daemon.add_overload(bsub)
    bench_llm.add_prefill(bsub)
    bench_llm.add_prefix_cache(bsub)
    bench_llm.add_prefix_soak(bsub)
    bench_engines.add_inplace_kv(bsub)
    bench_engines.add_weight_only(bsub)
