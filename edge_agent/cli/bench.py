"""``edge-agent bench``: benchmarks that print figures measured side by side. The workloads live in
``edge_agent/bench/`` and take their options as dataclasses (``bench/options.py``); their flags are parsed
here, one module per family: ``bench_llm.py`` (llm, tiers, grammar). ``overload`` still adds its own parser."""

from __future__ import annotations

import argparse

from ..bench import asr, calls, fleet, overload, serve, telemetry, voice
from . import bench_llm


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures measured side by side")
    bsub = p.add_subparsers(dest="bench_command", metavar="WORKLOAD", required=True)
    bench_llm.add_llm(bsub)
    bench_llm.add_tiers(bsub)
    asr.add_parser(bsub)
    telemetry.add_parser(bsub)
    fleet.add_parser(bsub)
    serve.add_parser(bsub)
    bench_llm.add_grammar(bsub)
    voice.add_parser(bsub)
    calls.add_parser(bsub)
    overload.add_parser(bsub)
