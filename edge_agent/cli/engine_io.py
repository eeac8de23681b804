"""What the engine commands share: the engine cache from the config and the report on stdout or in a file.

``--json`` prints the report as one JSON object on stdout, or writes it to the file given (then the
text still prints).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def open_cache(args: argparse.Namespace):
    """The settings and engine cache of ``--config`` (with its environment overrides)."""
    from ..config import load_settings
    from ..engines.cache import EngineCache

    settings = load_settings(args.config)
    return settings, EngineCache(settings.engines.cache_dir, settings.engines.max_bytes)


def emit(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    if args.json in (None, ""):
        print(text)
        return
    if args.json == "-":
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(text)
