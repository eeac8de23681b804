"""What a running daemon serves, recorded in the engine cache itself (``<cache_dir>/serving.json``).

The daemon writes tier -> {engine key, pid} each time a tier opens an engine (start, switch, swap);
``engines list`` reads it to mark the engines being served. A record whose process is gone is
ignored (and dropped at the next write), so a crash never leaves an engine marked as served.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SERVING = "serving.json"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process (the service's): alive
        return True
    return True


def _records(root: Path) -> dict[str, dict]:
    try:
        data = json.loads((root / SERVING).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(t): r for t, r in data.items() if isinstance(r, dict)}


def record_serving(root: Path, tier: str, key: str | None, pid: int | None = None) -> None:
    """Note that process ``pid`` (default: this one) serves engine ``key`` on ``tier`` (None: its model
    folder). Written atomically; records of gone processes are dropped."""
    pid = os.getpid() if pid is None else pid
    records = {t: r for t, r in _records(root).items() if _alive(int(r.get("pid", 0)))}
    records[tier] = {"key": key, "pid": pid, "since": time.time()}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{SERVING}.{pid}.tmp"
    tmp.write_text(json.dumps(records, indent=2, sort_keys=True))
    os.replace(tmp, root / SERVING)


def served_keys(root: Path) -> dict[str, list[str]]:
    """Engine key -> the tiers a live process serves it on."""
    out: dict[str, list[str]] = {}
    for tier, r in _records(root).items():
        if r.get("key") and _alive(int(r.get("pid", 0))):
            out.setdefault(str(r["key"]), []).append(tier)
    return out
