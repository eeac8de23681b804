"""SIGHUP: reload the config file in a running agent. Only the SLA applies in place (with the fleet's
stored ``desired`` on top of it); a change to any other section is named and waits for a restart.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .config import ASR_SLA_METRICS, load_settings
from .errors import ConfigError
from .serving.tier_policy import overlay, policy_from_config

if TYPE_CHECKING:
    from .agent import Agent
    from .telemetry.schema import SlaSpec

log = logging.getLogger(__name__)


def reload(agent: Agent) -> str:
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
    for section in ("models", "mqtt", "api", "telemetry", "engines", "audio", "device", "batching"):
        if getattr(new, section) != getattr(agent.settings, section):
            restart.append(section)
    agent.settings = agent.settings.model_copy(update={"sla": new.sla})
    s = agent.settings
    commands = agent.telemetry.commands if agent.telemetry is not None else None
    # The stored desired is folded in before anything is set, so that a reload that changes nothing
    # in force leaves the controllers' windows, truncation and shedding alone.
    stored = commands.stored_desired() if commands is not None else None
    fleet_sla: dict[str, SlaSpec] = stored.sla if stored is not None else {}
    for workload, controller, policy, window_s, every_s in (
        (
            "llm",
            agent.controller,
            lambda: policy_from_config(s.sla, max(t.max_batch for t in s.models.llm)),
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
        if sla is not None and (workload != "asr" or sla.metric in ASR_SLA_METRICS):
            base, window_s = overlay(base, sla), sla.window_s
        controller.set_policy(base, window_s, source="file")
        controller.evaluate_every_s = every_s
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
    message = f"reloaded: applied {', '.join(applied)}" + (
        f"; changes to {', '.join(restart)} take effect after a restart" if restart else ""
    )
    log.info("%s", message)
    agent.notifier.status(message[:200])
    return message
