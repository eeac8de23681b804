"""``edge-agent run``: the daemon as systemd runs it, one process around an ``agent.Agent``.

The state lock comes first; then the start with ``READY=1``, SIGHUP reloads framed by
``RELOADING=1``/``READY=1`` (``_Reloads``), SIGTERM/SIGINT drain and stop (exit 0), and an exit
without interpreter teardown when a build thread is still inside native code (``_exit_now``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ..config import load_settings
from ..daemon.app import Agent
from ..daemon.statelock import StateLock, state_dirs

log = logging.getLogger(__name__)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run the daemon (as systemd does): serve, measure, report, switch tiers")
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    # Also accepted before the command (edge-agent --log-format json run); given here, they win.
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=argparse.SUPPRESS,
        help="text, or one JSON object per line for journald/Loki (default: logging.format)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=argparse.SUPPRESS,
        help="default: logging.level (info)",
    )
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    level = "debug" if args.debug else getattr(args, "log_level", None)
    return run(args.config, log_format=getattr(args, "log_format", None), log_level=level)


def run(config: str | None, log_format: str | None = None, log_level: str | None = None) -> int:
    """The daemon. The state lock comes first: a second instance on the same spool and ledger exits
    here (``AlreadyRunning``, naming the holder's PID) before it touches MQTT, the spool or a model."""
    from ..daemon.startup_summary import startup_lines
    from ..logsetup import configure

    settings = load_settings(config)
    configure(log_level or settings.logging.level, log_format or settings.logging.format)
    lock = StateLock(state_dirs(settings)).acquire()
    try:
        for line in startup_lines(settings, config):
            if line.startswith("WARNING: "):
                log.warning("%s", line.removeprefix("WARNING: "))
            else:
                log.info("%s", line)
        return _serve(Agent(settings, config))
    finally:
        lock.release()


def _serve(agent: Agent) -> int:
    stop = threading.Event()
    reloads = _Reloads(agent)

    def on_stop(*_: object) -> None:
        stop.set()
        agent.cancel_builds()  # a build (even the one a start waits for) gives up at its next step

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, lambda *_: reloads.request())
    try:
        agent.start()
    except BaseException:
        reloads.stopping()
        finished = agent.stop()
        if stop.is_set():  # asked to stop while starting (e.g. during a build the start waited for)
            log.info("stopped during start")
            return 0 if finished else _exit_now(0)
        if not finished:
            _exit_now(1)
        raise
    reloads.serving()
    # A bounded wait, looped: the kernel may deliver SIGTERM to any thread, and Python runs the handler
    # only when the main thread runs bytecode, which a lock wait without a timeout never does again.
    while not stop.wait(0.5):
        pass
    log.info("stopping: draining")
    reloads.stopping()
    if not agent.stop():
        return _exit_now(0)
    return 0


def _exit_now(code: int) -> int:
    """Leave without interpreter teardown: a thread still inside native code (an engine build step
    past its bound) would make the C++ runtime abort (``terminate called…``, a core dump)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class _Reloads:
    """SIGHUP → ``RELOADING=1`` + ``MONOTONIC_USEC``, ``Agent.reload()``, then ``READY=1`` with the
    outcome on ``STATUS=`` (a refused file too: the running config keeps serving), so ``systemctl
    reload`` waits for the reload and reports it. One reload at a time; a SIGHUP during the start is
    done once serving; one during the stop is ignored."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._phase = "starting"
        self._pending = False

    def request(self) -> None:  # the signal handler: never blocks, the work runs on a thread
        threading.Thread(target=self._reload, name="reload", daemon=True).start()

    def _reload(self) -> None:
        with self._lock:
            if self._phase == "starting":
                self._pending = True
                log.info("SIGHUP during start: the configuration is re-read once serving")
                return
            if self._phase == "stopping":
                log.info("SIGHUP ignored: stopping")
                return
            self.agent.notifier.reloading()
            try:
                message = self.agent.reload()
            except Exception as exc:  # a reload must never take the daemon down
                log.exception("reload failed")
                message = f"reload failed, keeping the running config: {exc}"
            self.agent.notifier.notify(ready=1, status=message[:200])

    def serving(self) -> None:
        with self._lock:
            self._phase, pending = "serving", self._pending
        if pending:
            self._reload()

    def stopping(self) -> None:
        with self._lock:
            self._phase = "stopping"
