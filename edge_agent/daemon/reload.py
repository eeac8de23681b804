"""SIGHUP: reload the config file in a running agent. The SLA applies in place (with the fleet's
stored ``desired`` on top of it), and so does ``[logging] level``; a change to any other section is
named in the outcome and waits for a restart.

Every section of ``Settings`` is in ``APPLIED_LIVE`` or ``NEEDS_RESTART`` (``unclassified`` says which
are not, and a test holds it to that), so a section added later gets a decision. Whatever happens, a
changed section that is not applied in place is named: none is ever dropped without a word.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from .. import logsetup
from ..config import Settings, load_settings
from ..config.sla import sla_metric_problem
from ..errors import ConfigError
from ..serving.tiers.policy import overlay, policy_from_config

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import LoggingConfig
    from ..serving.tiers.control import TierController
    from ..systemd import Notifier
    from ..telemetry.remote_commands import CommandProcessor
    from ..telemetry.service import Telemetry


class Reloadable(Protocol):
    """What a reload reads and sets on a running agent (``Agent`` is one)."""

    settings: Settings  # a reload sets its SLA and logging

    @property
    def config_path(self) -> str | Path | None: ...

    @property
    def notifier(self) -> Notifier: ...

    @property
    def telemetry(self) -> Telemetry | None: ...

    @property
    def controller(self) -> TierController | None: ...

    @property
    def asr_controller(self) -> TierController | None: ...

    @property
    def remote(self) -> Any: ...  # publishes ``reported`` (``remote.RemoteTarget``)


log = logging.getLogger(__name__)

# Sections a reload applies in place: the SLA (with the stored desired on top), and the log level
# (the log format is named as needing a restart: one journal should not switch formats mid-stream).
APPLIED_LIVE = ("sla", "logging")
# Sections the running parts were built from at start (models loaded, sockets bound, threads sized,
# the capture's writer opened): a change waits for a restart and the reload says so.
NEEDS_RESTART = (
    "device",
    "models",
    "batching",
    "prefix_cache",
    "mqtt",
    "telemetry",
    "engines",
    "calibration",
    "api",
    "audio",
    "asr",
    "wyoming",
)


def unclassified(settings: type[Settings] = Settings) -> list[str]:
    """The sections of ``settings`` that are neither applied in place nor named as needing a restart."""
    return [name for name in settings.model_fields if name not in APPLIED_LIVE + NEEDS_RESTART]


def reload(agent: Reloadable) -> str:
    """SIGHUP: validate the file first; keep the running config when it is wrong, and say why. The
    file's SLA applies, then the fleet's stored ``desired`` on top of it (it overlays the file);
    a ``set_sla`` command's SLA gives way to them. ``reported`` is republished either way."""
    try:
        new = load_settings(agent.config_path)
    except ConfigError as exc:
        message = f"reload refused, keeping the running config: {exc}"
        log.error("%s", message)
        agent.notifier.status(message[:200])
        return message
    applied, restart = ["sla"], []
    kept: list[str] = []  # what the file asks but the command line overrides, as it would over a restart
    # Every section of the model, not a list kept by hand: a changed one not applied below is named.
    for section in type(new).model_fields:
        if section not in APPLIED_LIVE and getattr(new, section) != getattr(agent.settings, section):
            restart.append(section)
    logging_now = _reload_logging(agent.settings.logging, new.logging, applied, restart, kept)
    agent.settings = agent.settings.model_copy(update={"sla": new.sla, "logging": logging_now})
    commands = agent.telemetry.commands if agent.telemetry is not None else None
    _apply_sla(agent, commands)
    if commands is not None:
        if commands.reapply_desired():
            applied.append(f"the fleet's desired version {commands.desired_in_force} on top")
        for controller in (agent.controller, agent.asr_controller):
            # A pin from a desired that is no longer stored (reset_desired) goes with it.
            if (
                controller is not None
                and commands.desired_in_force is None
                and controller.pin_source.startswith("desired@")
            ):
                controller.unpin(source="file")
    agent.remote.publish_reported()
    message = (
        f"reloaded: applied {', '.join(applied)}"
        + "".join(f"; {note}" for note in kept)
        + (f"; changes to {', '.join(restart)} take effect after a restart" if restart else "")
    )
    log.info("%s", message)
    agent.notifier.status(message[:200])
    return message


def _apply_sla(agent: Reloadable, commands: CommandProcessor | None) -> None:
    """Each controller's policy from the file, the fleet's stored desired SLA on top. The stored desired
    is folded in before anything is set, so that a reload that changes nothing in force leaves the
    controllers' windows, truncation and shedding alone."""
    s = agent.settings
    stored = commands.stored_desired() if commands is not None else None
    fleet_sla = stored.sla if stored is not None else {}
    for workload, controller, policy, window_s, every_s in (
        (
            "llm",
            agent.controller,
            lambda: policy_from_config(s.sla, max(t.rows(s.batching) for t in s.models.llm)),
            s.sla.window_s,
            s.sla.evaluate_every_s,
        ),
        (
            "asr",
            agent.asr_controller,
            lambda: policy_from_config(s.sla.asr),
            s.sla.asr.window_s,
            s.sla.asr.evaluate_every_s,
        ),
    ):
        if controller is None:
            continue
        base, sla = policy(), fleet_sla.get(workload)
        if sla is not None and sla_metric_problem(workload, sla.metric) is None:
            base, window_s = overlay(base, sla), sla.window_s
        controller.set_policy(base, window_s, source="file")
        controller.evaluate_every_s = every_s


def _reload_logging(
    running: LoggingConfig, new: LoggingConfig, applied: list[str], restart: list[str], kept: list[str]
) -> LoggingConfig:
    """Apply ``[logging] level`` now when the file's level is the one in force; a level given on the
    command line (``--log-level``, ``--debug``) stays, as it would over a restart, and is named in
    ``kept``. The format is named in ``restart``. Returns the logging config now in force."""
    now = running
    if new.level != running.level:
        in_force = logsetup.level_in_force()
        if in_force is None:  # logging belongs to a program that runs the agent inside it
            restart.append("logging.level")
        elif in_force != running.level:
            kept.append(f"logging level stays {in_force} (given on the command line)")
            now = now.model_copy(update={"level": new.level})
        else:
            logsetup.set_level(new.level)
            applied.append(f"logging level {running.level} → {new.level}")
            now = now.model_copy(update={"level": new.level})
    if new.format != running.format:
        restart.append("logging.format")
    return now
