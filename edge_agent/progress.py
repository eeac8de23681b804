"""A progress line with rate and ETA on stderr, for builds, calibration and downloads of weights.

On a terminal it redraws one line; otherwise (systemd journal, CI logs) it prints a line at most
every few seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """One progress line (done, rate, ETA): redrawn on a terminal, printed every few seconds otherwise."""

    def __init__(
        self,
        label: str,
        unit: str = "",
        enabled: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_interval_s: float | None = None,
    ) -> None:
        self.label = label
        self.unit = unit
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.clock = clock
        self.tty = self.stream.isatty()
        self.min_interval_s = min_interval_s if min_interval_s is not None else (0.1 if self.tty else 5.0)
        self._start = clock()
        self._last = float("-inf")
        self._shown = False

    def update(self, done: float, total: float | None = None) -> None:
        if not self.enabled:
            return
        now = self.clock()
        finished = total is not None and done >= total
        if now - self._last < self.min_interval_s and not finished:
            return
        self._last = now
        self.stream.write(
            ("\r" if self.tty else "") + self.format(done, total, now - self._start) + ("" if self.tty else "\n")
        )
        self.stream.flush()
        self._shown = True

    def format(self, done: float, total: float | None, elapsed_s: float) -> str:
        rate = done / elapsed_s if elapsed_s > 0 else 0.0
        unit = f" {self.unit}" if self.unit else ""
        if total:
            pct = min(100.0, 100.0 * done / total)
            eta = (total - done) / rate if rate > 0 else float("inf")
            eta_text = f"{eta:4.0f}s" if eta != float("inf") else "  ?s"
            width = 24
            filled = int(width * pct / 100)
            return (
                f"{self.label}: [{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}% "
                f"{done:.1f}/{total:.1f}{unit} · {rate:.1f}{unit}/s · ETA {eta_text}"
            )
        return f"{self.label}: {done:.1f}{unit} · {rate:.1f}{unit}/s · {elapsed_s:.0f}s"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()
