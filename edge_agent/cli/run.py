"""``edge-agent run``: the daemon, as systemd runs it (``edge_agent/agent.py`` does the work)."""
from __future__ import annotations

import argparse


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run the daemon (as systemd does): serve, measure, report, switch tiers")
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    # Also accepted before the command (edge-agent --log-format json run); given here, they win.
    p.add_argument("--log-format", choices=["text", "json"], default=argparse.SUPPRESS,
                   help="text, or one JSON object per line for journald/Loki (default: logging.format)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=argparse.SUPPRESS,
                   help="default: logging.level (info)")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    from ..agent import run

    level = "debug" if args.debug else getattr(args, "log_level", None)
    return run(args.config, log_format=getattr(args, "log_format", None), log_level=level)
