"""``edge-agent check-config`` and ``doctor``: what this machine and its config hold."""

from __future__ import annotations

import argparse
import sys

from .common import add_common, emit_json


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-config", help="validate the configuration and print every problem")
    add_common(p)
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("doctor", help="what runtimes, devices and versions this machine has")
    add_common(p)
    p.set_defaults(func=cmd_doctor)


def cmd_check_config(args: argparse.Namespace) -> int:
    from ..config import resolve_config_path
    from ..diagnostics.preflight import config_problems

    source = resolve_config_path(args.config)
    problems = config_problems(args.config)
    if args.json:
        emit_json(
            {
                "ok": not problems,
                "source": str(source) if source else None,
                "problems": [{"path": p, "message": m} for p, m in problems],
            }
        )
    else:
        for path, msg in problems:
            print(f"{path}: {msg}")
        if not problems:
            print(f"configuration OK ({source or 'built-in defaults'} + EDGE_AGENT_* environment)")
        else:
            print(
                f"{len(problems)} problem(s) in {source or 'built-in defaults'} + EDGE_AGENT_* environment",
                file=sys.stderr,
            )
    return 2 if problems else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..diagnostics import doctor

    report = doctor.collect(config=args.config)
    if args.json:
        emit_json(report)
    else:
        print(doctor.render_table(report))
    return 0
