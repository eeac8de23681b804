"""The ``edge-agent`` command line: one module per command group, registered here by name.

    run.py       run the daemon (as systemd does)
    generate.py  text from a prompt
    asr.py       transcribe, listen
    engines.py   calibrate, build, engines list/verify/prune
    eval.py      eval asr
    bench.py     bench: its workloads' flags in bench_llm.py (llm, tiers, grammar, prefill, prefix-cache,
                 prefix-soak), bench_speech.py (asr, voice, calls), bench_daemon.py (telemetry, fleet, serve,
                 overload) and bench_engines.py (weight-only, inplace-kv)
    fleet.py     fleet watch/keygen/sign
    demo.py      demo
    doctor.py    check-config, doctor (diagnostics/)
    models.py    models list/import/fetch (importers/)

Every command that reports takes ``--json``; a failure prints one line on stderr (a traceback
only with ``--debug``) and exits non-zero: 2 for bad usage or config, 1 for everything else.
Command modules keep their heavy imports inside the handlers, so ``--help`` stays fast. Nothing in
``edge_agent`` imports this package: it sits on top of everything else.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from .. import __version__
from ..errors import ConfigError, EdgeAgentError
from . import asr, bench, demo, doctor, engines, eval, fleet, generate, models, run

log = logging.getLogger("edge_agent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="Edge inference agent: builds engines, serves ASR and LLMs, measures latency, reports over MQTT.",
    )
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="text, or one JSON object per line (time, level, logger, message) for journald/Loki; "
        "`run` defaults to logging.format",
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=None,
        help="default: warning (`run`: logging.level, info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The order is the order of `edge-agent --help`.
    doctor.add_commands(sub)
    models.add_commands(sub)
    generate.add_commands(sub)
    fleet.add_commands(sub)
    eval.add_commands(sub)
    asr.add_commands(sub)
    run.add_commands(sub)
    demo.add_commands(sub)
    engines.add_commands(sub)
    bench.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..logsetup import configure

    configure("debug" if args.debug else (args.log_level or "warning"), args.log_format or "text")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        if args.debug:
            raise
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    except EdgeAgentError as exc:
        if args.debug:
            raise
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edge-agent: interrupted", file=sys.stderr)
        return 130
