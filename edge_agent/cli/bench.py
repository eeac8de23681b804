"""``edge-agent bench``: benchmarks that print figures measured side by side (one module per workload
in ``edge_agent/bench/``, each adding its own parser)."""

from __future__ import annotations

import argparse

from ..bench import asr, calls, fleet, grammar, llm, overload, serve, telemetry, tiers, voice


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures measured side by side")
    bsub = p.add_subparsers(dest="bench_command", metavar="WORKLOAD", required=True)
    llm.add_parser(bsub)
    tiers.add_parser(bsub)
    asr.add_parser(bsub)
    telemetry.add_parser(bsub)
    fleet.add_parser(bsub)
    serve.add_parser(bsub)
    grammar.add_parser(bsub)
    voice.add_parser(bsub)
    calls.add_parser(bsub)
    overload.add_parser(bsub)
