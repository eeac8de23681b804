"""``edge-agent check-config``, ``doctor`` and ``models list``: what this machine and its config hold."""

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

    p = sub.add_parser("models", help="demo and configured models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    q = msub.add_parser("list", help="list demo models and the configured tiers")
    add_common(q)
    q.set_defaults(func=cmd_models_list)


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


def cmd_models_list(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..models.catalog import DEMO_MODELS, demo_status

    settings = load_settings(args.config)
    cache = settings.models.cache_dir
    demos = [
        {"name": m.name, "kind": m.kind, "status": demo_status(m, cache), "description": m.description}
        for m in DEMO_MODELS.values()
    ]
    tiers = {w: [t.model_dump() for t in getattr(settings.models, w)] for w in ("llm", "asr")}
    if args.json:
        emit_json({"demo_models": demos, "tiers": tiers})
        return 0
    print(f"{'NAME':<18} {'KIND':<12} {'STATUS':<26} DESCRIPTION")
    for d in demos:
        print(f"{d['name']:<18} {d['kind']:<12} {d['status']:<26} {d['description']}")
    print("\nconfigured tiers (heaviest first):")
    for workload, items in tiers.items():
        for t in items:
            print(f"  {workload}: {t['name']:<8} {t['model']:<18} {t['backend']} {t['device']} {t['precision']}")
    return 0
