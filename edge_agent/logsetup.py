"""Log output for people (text) and for journald/Loki (one JSON object per line).

``--log-format json`` or ``[logging] format = "json"``: each record is one line
``{"time": "2026-12-01T02:31:38.414Z", "level": "INFO", "logger": "edge_agent.daemon.app", "message": "…"}``,
plus ``exception`` (the formatted traceback) when the record carries one, and ``thread`` when it is
not the main thread. Timestamps are UTC with milliseconds, so lines from several devices sort.

The level can change while running (``set_level``: a SIGHUP with a new ``[logging] level``); the
format cannot (a new handler mid-stream would mix two formats in one journal).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What configure() or set_level() last set, so that a reload can tell whether the level in force is
# the file's (then it may change it) or a command-line flag's. None: edge-agent did not set up logging.
_in_force: dict[str, str | None] = {"level": None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.threadName and record.thread != threading.main_thread().ident:
            out["thread"] = record.threadName
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str | int = "warning", fmt: str = "text", stream: IO[str] | None = None) -> None:
    """Set the root logger's one handler (replacing earlier ones) to ``fmt`` at ``level``."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    numeric = _numeric(level)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    _set(level, numeric)
    logging.captureWarnings(True)  # Python warnings become records too: one format on stderr


def set_level(level: str) -> None:
    """Change the level in force, keeping the handler and its format (a reload's ``[logging] level``)."""
    _set(level, _numeric(level))


def level_in_force() -> str | None:
    """The level ``configure``/``set_level`` last set (``"info"``…), or None when edge-agent never set up
    logging in this process (it runs inside another program, whose logging is not its to change)."""
    return _in_force["level"]


def _numeric(level: str | int) -> int:
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    return numeric


def _set(level: str | int, numeric: int) -> None:
    logging.getLogger().setLevel(numeric)
    logging.getLogger("edge_agent").setLevel(numeric)
    _in_force["level"] = level.lower() if isinstance(level, str) else logging.getLevelName(numeric).lower()


LOG_EVERY_S = 10.0  # a flood of one kind of bad input logs one line (with a count) per this period


class LogLimiter:
    """At most one log line per ``period_s`` per key; the next line that gets through says how many
    were held back, so a flood costs a line per period instead of a line per message. Keys must come
    from a fixed set (never from a message), so the limiter's memory stays bounded too. Used for every
    message that reaches the command path (fleet commands, ``desired``, Home Assistant's select) and
    for requests whose output format breaks."""

    def __init__(
        self,
        period_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.period_s, self.clock = period_s, clock
        self.log = logger or logging.getLogger(__name__)
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, level: int, key: str, fmt: str, *args: Any) -> bool:
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.period_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held and last is not None:
            fmt, args = fmt + " (and %d more like it in the last %.0f s)", (*args, held, now - last)
        self.log.log(level, fmt, *args)
        return True
