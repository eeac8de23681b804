"""What every command shares: ``--config``/``--json`` arguments and the JSON printer."""

from __future__ import annotations

import argparse
import json
import sys


def add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
