"""Third-party noise around the quantizers, folded into the log at debug level.

NNCF draws its own rich progress bars and logs statistics tables through a handler of its own;
numpy warns "overflow encountered in reduce" while a calibrator takes ranges; tqdm bars appear from
libraries below. None of it is for the person running ``build``: our own progress line (created
before the call, so bound to the real stderr) already says where the build is. ``folded`` captures
Python-level stdout/stderr, warnings and the NNCF logger for the span of one call and replays them
with ``log.debug`` (``--log-level debug`` shows them); an error still raises as before.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator

log = logging.getLogger(__name__)

_LOGGERS = ("nncf",)  # third-party loggers with handlers of their own (they do not propagate to ours)


class _ToDebug(logging.Handler):
    """Re-emits a third-party record on our logger: at debug, or as a warning when it is an error."""

    def __init__(self, tool: str) -> None:
        super().__init__(logging.DEBUG)
        self.tool = tool

    def emit(self, record: logging.LogRecord) -> None:
        level = logging.WARNING if record.levelno >= logging.ERROR else logging.DEBUG
        log.log(level, "%s: %s", self.tool, record.getMessage())


def _replay(tool: str, what: str, text: str) -> None:
    for line in text.splitlines():
        line = line.rsplit("\r", 1)[-1].strip()  # a progress bar redraws with \r: its last state
        if line:
            log.debug("%s %s: %s", tool, what, line)


@contextlib.contextmanager
def folded(tool: str) -> Iterator[None]:
    """Run the block with ``tool``'s own output, progress bars and warnings going to the debug log."""
    out, err = io.StringIO(), io.StringIO()
    saved = {}
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (logger.handlers[:], logger.propagate)
        logger.handlers[:] = [_ToDebug(tool)]
        logger.propagate = False
    tqdm_env = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield
    finally:
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
        for name, (handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.propagate = propagate
        for w in caught:
            log.debug("%s warning: %s:%s: %s: %s", tool, w.filename, w.lineno, w.category.__name__, w.message)
        _replay(tool, "stdout", out.getvalue())
        _replay(tool, "stderr", err.getvalue())
