"""Home Assistant MQTT discovery for one device (opt-in ``[mqtt] homeassistant_discovery``).

When enabled, every birth publishes, retained, one discovery config per entity under
``<homeassistant_prefix>/<component>/<node>/<key>/config``: sensors for LLM TTFT P95/P99, ASR first
partial P95, tokens/s and CPU temperature (read by ``value_template`` from the device's own
``tele/latency`` windows), the active tier (from ``reported``), and a ``select`` per workload that
pins a tier ("auto" unpins). All entities share one ``device`` block and take their availability
from the retained ``state`` (the Last Will included), so they go unavailable with the device.

The select's command topic is ``<prefix>/<device_id>/ha/tier/<workload>/set``; a choice there
becomes a ``pin_tier`` / ``unpin_tier`` request handed to the device's command processor, so the
allow-list (``telemetry.commands_allowed``), the signing rule (``telemetry.fleet_public_key``: a plain
choice is unsigned and refused) and the ledger apply as to any fleet command; its responses go to
``cmd/<name>/res``. The select is left out when it could not work (pin/unpin not allowed, or a fleet
key is set). A flood of choices is treated as a flood of commands: its log lines go through the
command path's per-reason limit (``remote_commands.LogLimiter``: one line per command per
``LOG_EVERY_S``, the next saying how many were held back), and a choice that finds the command
queue full is dropped and counted in ``commands_dropped`` (``queue_full``) like any command.

Removal: the topics published are remembered in a small file beside the spool; when discovery is
turned off (or an entity is no longer offered) the next birth clears them with empty retained
payloads, which is how Home Assistant removes a discovered entity.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..logsetup import LogLimiter
from .client import Incoming, Outgoing

log = logging.getLogger(__name__)

AUTO = "auto"  # the select option that unpins
SET_TOPIC = "ha/tier/+/set"  # below <prefix>/<device_id>/, subscribed when the select is offered
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")  # what a discovery topic level may hold
_ENTITY = re.compile(r"[^a-z0-9_]")  # what an entity id may hold (lower case)

# The ``llm`` series of a window, when it has the metric; the first one (a window rarely has two).
_LLM = "value_json.series | selectattr('workload', 'equalto', '{w}') | selectattr('local.{m}', 'defined') | list"


def _quantile_template(workload: str, metric: str, q: str) -> str:
    # "None" makes Home Assistant show the sensor as unknown: a window without such requests has no P95.
    sel = _LLM.format(w=workload, m=metric)
    value = f"s[0].local.{metric}.{q}"
    return f"{{% set s = {sel} %}}{{{{ {value} if s and {value} is not none else 'None' }}}}"


def _sensors(workloads: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """(key, entity config without the shared parts) of every sensor the device offers."""
    ms = {"unit_of_measurement": "ms", "device_class": "duration", "state_class": "measurement"}
    out: list[tuple[str, dict[str, Any]]] = []
    if "llm" in workloads:
        out += [
            (
                "llm_ttft_p95",
                {"name": "LLM TTFT P95", **ms, "value_template": _quantile_template("llm", "ttft_ms", "p95")},
            ),
            (
                "llm_ttft_p99",
                {"name": "LLM TTFT P99", **ms, "value_template": _quantile_template("llm", "ttft_ms", "p99")},
            ),
            (
                "llm_tokens_per_s",
                {
                    "name": "LLM tokens/s",
                    "unit_of_measurement": "tok/s",
                    "state_class": "measurement",
                    "value_template": "{{ value_json.series | selectattr('workload', 'equalto', 'llm') "
                    "| map(attribute='throughput.tokens_per_s') | sum | round(2) }}",
                },
            ),
        ]
    if "asr" in workloads:
        out.append(
            (
                "asr_first_partial_p95",
                {
                    "name": "ASR first partial P95",
                    **ms,
                    "value_template": _quantile_template("asr", "first_partial_ms", "p95"),
                },
            )
        )
    out.append(
        (
            "cpu_temperature",
            {
                "name": "CPU temperature",
                "unit_of_measurement": "°C",
                "device_class": "temperature",
                "state_class": "measurement",
                "value_template": "{% set h = value_json.health if value_json.health is defined else {} %}"
                "{{ h.max_temp_c if h.max_temp_c is defined and h.max_temp_c is not none else 'None' }}",
            },
        )
    )
    return out


class Discovery:
    """Discovery configs for one device, the clearing of stale ones, and the select's command path."""

    def __init__(
        self,
        *,
        enabled: bool,
        ha_prefix: str,
        topic: Callable[[str], str],
        device_id: str,
        version: str,
        marker: Path,
        select_allowed: bool,
        submit: Callable[[Incoming], None] | None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled, self.ha_prefix, self.topic = enabled, ha_prefix.rstrip("/"), topic
        self.device_id, self.version, self.marker = device_id, version, marker
        self.select_allowed = select_allowed and submit is not None
        self.submit, self.wall = submit, wall
        self.limited = LogLimiter(clock=clock, logger=log)
        self.node = "edge_agent_" + _UNSAFE.sub("_", device_id)
        self._ids = itertools.count(1)

    @property
    def subscriptions(self) -> tuple[str, ...]:
        return (SET_TOPIC,) if self.enabled and self.select_allowed else ()

    def _shared(self) -> dict[str, Any]:
        return {
            "device": {
                "identifiers": [self.node],
                "name": self.device_id,
                "manufacturer": "edge-agent",
                "model": "edge-agent",
                "sw_version": self.version,
            },
            "origin": {"name": "edge-agent", "sw_version": self.version},
            # The state payload is JSON: degraded still serves, so only "offline" (incl. the Will) is unavailable.
            "availability_topic": self.topic("state"),
            "availability_template": "{{ 'offline' if value_json.state == 'offline' else 'online' }}",
            "payload_available": "online",
            "payload_not_available": "offline",
        }

    def _entity(self, component: str, key: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        uid = f"{self.node}_{key}"
        return (
            f"{self.ha_prefix}/{component}/{self.node}/{key}/config",
            {
                **body,
                "unique_id": uid,
                "default_entity_id": f"{component}.{_ENTITY.sub('_', uid.lower())}",
                **self._shared(),
            },
        )

    def configs(self, tiers: Mapping[str, Sequence[str]]) -> dict[str, dict[str, Any]]:
        """Discovery topic -> config for the workloads configured (``tiers``: workload -> tier names)."""
        out = dict(
            self._entity("sensor", k, {**b, "state_topic": self.topic("tele/latency")})
            for k, b in _sensors(list(tiers))
        )
        for workload in tiers:
            tier = {
                "name": f"{workload.upper()} active tier",
                "state_topic": self.topic("reported"),
                "value_template": f"{{% set t = value_json.active_tiers %}}{{{{ t.{workload} "
                f"if t.{workload} is defined else 'None' }}}}",
            }
            out.update([self._entity("sensor", f"{workload}_active_tier", tier)])
            if not (self.select_allowed and tiers[workload]):
                continue
            pin = {
                "name": f"{workload.upper()} tier pin",
                "options": [AUTO, *tiers[workload]],
                "command_topic": self.topic(f"ha/tier/{workload}/set"),
                "state_topic": self.topic("reported"),
                "value_template": f"{{% set p = value_json.pins %}}{{{{ p.{workload} if p.{workload} is defined "
                f"else '{AUTO}' }}}}",
            }
            out.update([self._entity("select", f"{workload}_tier_pin", pin)])
        return out

    def birth(self, tiers: Mapping[str, Sequence[str]]) -> list[Outgoing]:
        """The retained configs (when enabled) and empty retained payloads for topics no longer offered."""
        current = self.configs(tiers) if self.enabled else {}
        stale = sorted(set(self._remembered()) - set(current))
        msgs = [Outgoing(t, json.dumps(c, separators=(",", ":")).encode(), retain=True) for t, c in current.items()]
        msgs += [Outgoing(t, b"", retain=True) for t in stale]
        if stale:
            log.info("clearing %d Home Assistant discovery topics no longer offered", len(stale))
        self._remember(sorted(current))
        return msgs

    def _remembered(self) -> list[str]:
        try:
            topics = json.loads(self.marker.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s): stale Home Assistant discovery topics are not cleared", self.marker, exc)
            return []
        return [t for t in topics if isinstance(t, str)] if isinstance(topics, list) else []

    def _remember(self, topics: list[str]) -> None:
        try:
            if topics:
                self.marker.parent.mkdir(parents=True, exist_ok=True)
                self.marker.write_text(json.dumps(topics))
            else:
                self.marker.unlink(missing_ok=True)
        except OSError as exc:  # discovery still works; only a later clean-up would miss these topics
            log.warning("cannot record Home Assistant discovery topics in %s: %s", self.marker, exc)

    def handles(self, topic: str) -> bool:
        parts = topic.split("/")
        return topic.startswith(self.topic("ha/tier/")) and len(parts) >= 2 and parts[-1] == "set"

    def on_select(self, msg: Incoming) -> None:
        """A choice on a select's command topic, as a ``pin_tier`` / ``unpin_tier`` request."""
        workload = msg.topic[len(self.topic("ha/tier/")) :].removesuffix("/set")
        if self.submit is None or not self.select_allowed:
            return
        if msg.retain:  # a retained choice would re-pin at every reconnect, long after someone chose it
            self.limited(logging.WARNING, "retained", "ignored a retained Home Assistant tier choice on %s", msg.topic)
            return
        choice = msg.payload[:64].decode("utf-8", "replace").strip()
        if choice == AUTO:
            name, args = "unpin_tier", {"workload": workload}
        else:
            name, args = "pin_tier", {"workload": workload, "tier": choice}
        cmd_id = f"ha-{int(self.wall() * 1000)}-{next(self._ids)}"
        body = json.dumps({"cmd_id": cmd_id, "args": args}).encode()
        # Keyed by command, never by the topic's workload: the limiter's keys must not grow with a flood.
        self.limited(logging.INFO, name, "Home Assistant asks %s %s (%s)", name, args, cmd_id)
        self.submit(Incoming(self.topic(f"cmd/{name}/req"), body, None, None, None, False))
