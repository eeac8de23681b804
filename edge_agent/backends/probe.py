"""Crash-safe probes: a few lines of Python run in a child interpreter with a timeout.

Loading a GPU, NPU or audio driver, or TensorRT, can segfault or hang a process without a working
device; a probe keeps that out of the caller (``edge-agent doctor``, the TensorRT version check).
The child prints one JSON object as its last line; a crash, hang or exception becomes ``error``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]  # so a probe child can import edge_agent from a checkout

# Test hook: code run first in the named probe's child process (e.g. to make it segfault).
PRELUDE: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """What a child probe returned: its last printed JSON object, or why there is none."""

    data: dict[str, Any]  # the JSON object the child printed last; {} on failure
    error: str | None  # why there is no result: timeout, signal, exit code


def run_probe(code: str, timeout_s: float, name: str | None = None) -> ProbeRun:
    """Run ``code`` in a child Python; it must print one JSON object as its last line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    source = PRELUDE.get(name or "", "") + "\n" + code
    try:
        proc = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return ProbeRun({}, f"probe timed out after {timeout_s:g} s (killed)")
    except OSError as exc:
        return ProbeRun({}, f"probe could not start {sys.executable}: {exc}")
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = "an unknown signal"
        return ProbeRun({}, f"probe crashed: killed by {sig} (signal {-proc.returncode}, exit code {proc.returncode})")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return ProbeRun({}, f"probe exited with code {proc.returncode}: {last}")
    try:
        data = json.loads((proc.stdout.strip().splitlines() or ["null"])[-1])
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return ProbeRun({}, "probe printed no result")
    return ProbeRun(data, None)
