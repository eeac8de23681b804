"""Wiring of the telemetry parts for one device: the seam the agent (and the benchmark) use.

    svc = Telemetry(settings.mqtt, settings.telemetry, version=__version__, target=my_target).start()
    observers.register(svc.observe)  # every ``observe.Observation``, LLM and ASR
    scheduler = LLMScheduler(lm, on_finished=svc.llm_observer("small", "demo-phi3-small"))  # a bare scheduler
    svc.emit_event("tier_switch", {...})
    svc.stop()

It owns: the spool (and ``seq`` / session), the command ledger, the MQTT link with its Will and birth
messages (``state`` online, ``meta``, ``reported``), the publisher thread and the command worker.
Each part gets only its own config section.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import MqttConfig, TelemetryConfig
from ..metrics.histogram import DEFAULT_MAX_SIZE, relative_error
from ..metrics.timing import RequestTiming
from ..observe import Observation
from .admission import AdmissionDeltas, AdmissionTotals
from .client import Incoming, MqttLink, Outgoing, response_properties
from .health import HealthReader
from .homeassistant import Discovery
from .inventory import InventoryBook
from .ledger import Ledger
from .publisher import Identity, Publisher, kernel_clock_synced, read_boot_id
from .remote_commands import CommandProcessor, CommandTarget
from .schema import SCHEMA_VERSIONS, Inventory, Meta, Reported, State
from .signing import Verifier, command_channel_warnings, load_public_key
from .spool import Spool
from .windows import WindowAccumulator

log = logging.getLogger(__name__)

# With 160 buckets a latency range of 20 ms - 640 ms stays at scale 5 (1.1 %); wider ranges
# downscale. The meta message states the bound for the scale fleets should expect.
NOMINAL_SCALE = 5


class Telemetry:
    """The telemetry side of one device (see the module doc): ``observe`` on the hot path,
    ``emit_event`` for events, ``start``/``stop`` around the rest."""

    calibration_capture = "off"  # [calibration] capture, as meta reports it (the agent sets it before start)
    _meta_engines: dict[str, str] = {}  # noqa: RUF012 - replaced whole, never mutated: the hashes meta last carried

    def __init__(
        self,
        mqtt: MqttConfig,
        telemetry: TelemetryConfig,
        *,
        version: str = __version__,
        target: CommandTarget | None = None,
        capabilities: Iterable[str] = ("llm",),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        clock_synced: Callable[[], bool] = kernel_clock_synced,
        live_age_s: float | None = None,
        inventory: InventoryBook | None = None,
        health_root: str | Path = "/",
        admission: Callable[[], AdmissionTotals] | None = None,
    ) -> None:
        """``admission``: the agent's running totals of refusals and preemptions (``prometheus_totals``
        of its ``/metrics``); each window carries what they grew by. None: windows leave them out."""
        self.mqtt_cfg, self.cfg = mqtt, telemetry
        self.version, self.target, self.capabilities = version, target, list(capabilities)
        self.wall = wall
        self.spool = Spool(telemetry.spool_path, telemetry.spool_max_bytes, telemetry.spool_max_records, wall=wall)
        self.identity = Identity(mqtt.device_id, version, read_boot_id())
        self.accumulator = WindowAccumulator()
        self.discovery = self._discovery(mqtt, telemetry, target, wall)
        self.link = MqttLink(
            mqtt,
            will=self._state("offline", "connection lost (last will)"),
            birth=self._birth_with_discovery,
            on_message=self._on_message,
            subscriptions=("cmd/+/req", "desired", *self.discovery.subscriptions),
            max_inflight=mqtt.max_inflight,
            max_delay_s=mqtt.reconnect_max_s,
        )
        # Each window carries the device's health; the inventory rides on the retained meta.
        self.health = HealthReader(health_root, clock=clock)
        self.publisher = Publisher(
            self.link,
            self.spool,
            self.accumulator,
            self.identity,
            interval_s=telemetry.interval_s,
            replay_per_s=telemetry.replay_per_s,
            max_inflight=mqtt.max_inflight,
            clock=clock,
            wall=wall,
            clock_synced=clock_synced,
            live_age_s=live_age_s,
            on_degraded=self._spool_degraded,
            health=self.health.snapshot,
            admission=AdmissionDeltas(admission).take if admission is not None else None,
        )
        self.inventory = inventory
        # A spool that starts on a full disk is degraded from the first birth message on.
        self._state_now: tuple[str, str | None] = (
            ("degraded", self.spool.degraded[:512]) if self.spool.degraded else ("online", None)
        )
        self.ledger: Ledger | None = None
        self.commands: CommandProcessor | None = None
        self.warnings: list[str] = []
        if target is not None:
            self.ledger = Ledger(telemetry.ledger_path, wall=wall)
            self.commands = self._command_processor(target, self.ledger, clock, wall)
            # Loud, at every start and in the retained meta: anyone on this broker can steer the device.
            self.warnings = command_channel_warnings(mqtt, telemetry)
            for warning in self.warnings:
                log.warning("%s", warning)
        if self.spool.recovered_from is not None:
            log.error("telemetry spool was damaged and rebuilt; the damaged file is %s", self.spool.recovered_from)

    def _discovery(
        self, mqtt: MqttConfig, telemetry: TelemetryConfig, target: CommandTarget | None, wall: Callable[[], float]
    ) -> Discovery:
        """Home Assistant discovery (opt-in); its tier select is a pin/unpin through the command processor."""
        return Discovery(
            enabled=mqtt.homeassistant_discovery,
            ha_prefix=mqtt.homeassistant_prefix,
            topic=lambda suffix: f"{mqtt.topic_prefix}/{mqtt.device_id}/{suffix}",
            device_id=mqtt.device_id,
            version=self.version,
            marker=telemetry.spool_path.with_name(telemetry.spool_path.name + ".homeassistant.json"),
            select_allowed=target is not None
            and not telemetry.fleet_public_key
            and {"pin_tier", "unpin_tier"} <= set(telemetry.commands_allowed),
            submit=self._submit_command,
            wall=wall,
        )

    def _command_processor(
        self, target: CommandTarget, ledger: Ledger, clock: Callable[[], float], wall: Callable[[], float]
    ) -> CommandProcessor:
        """The fleet's commands and ``desired``, verified with the fleet's key when one is configured."""
        telemetry, mqtt = self.cfg, self.mqtt_cfg
        key = load_public_key(telemetry.fleet_public_key) if telemetry.fleet_public_key else None
        return CommandProcessor(
            target,
            ledger,
            self.link.prefix,
            mqtt.device_id,
            self._respond,
            self._publish_reported,
            max_bytes=telemetry.max_command_bytes,
            clock=clock,
            wall=wall,
            verifier=Verifier(key, wall, telemetry.max_signature_lifetime_s),
            allowed=telemetry.commands_allowed,
            reply_prefixes=telemetry.reply_prefixes,
            on_drops=lambda data: self.emit_event("commands_dropped", data),
        )

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> Telemetry:
        if self.commands:
            self.commands.start()
        self.publisher.start()
        self.link.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Seal the last window, give the pump a moment, say "offline" cleanly, close everything."""
        sealed = self.publisher.stats["windows"]
        self.publisher.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.publisher.stats["windows"] == sealed:
            time.sleep(0.01)
        while (
            time.monotonic() < deadline
            and self.link.connected.is_set()
            and (self.spool.records or self.publisher.inflight)
        ):
            time.sleep(0.05)
        self.publisher.stop()
        self.link.stop(final_state=self._state("offline", "agent stopped"))
        if self.commands:
            self.commands.stop()
        self.spool.close()
        if self.ledger:
            self.ledger.close()

    # -- the hot-path seams ---------------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        """An ``observe.Observers`` consumer: one lock + histogram updates, no I/O. The first request
        after a load (or a warm-up) is left out: it measures loading, not serving."""
        if obs.first_after_load:
            return
        self.accumulator.observe(
            obs.workload, obs.tier, obs.model, obs.samples, tokens_out=obs.tokens_out, engine_hash=obs.engine
        )

    def llm_observer(self, tier: str, model: str, engine_hash: str | None = None) -> Callable[[RequestTiming], None]:
        """An ``on_finished`` callback for ``LLMScheduler``: one lock + histogram updates, no I/O."""
        acc = self.accumulator

        def observe(timing: RequestTiming) -> None:
            acc.observe_timing("llm", tier, model, timing, engine_hash=engine_hash)

        return observe

    def emit_event(self, type_: str, data: dict[str, Any] | None = None) -> None:
        self.publisher.emit_event(type_, data)

    def set_state(self, state: str, reason: str | None = None) -> None:
        """Publish ``state`` now (``online`` / ``degraded``), retained; repeated on every reconnect."""
        if state not in ("online", "degraded"):
            raise ValueError(f"state must be 'online' or 'degraded', got {state!r} (offline is the Will)")
        self._state_now = (state, reason)
        self.link.publish(self.link.topic("state"), self._state(state, reason), qos=1, retain=True)

    def _spool_degraded(self, reason: str | None) -> None:
        """The spool cannot store records (a full disk), or can again: the retained ``state`` says so."""
        self.set_state("degraded" if reason else "online", reason[:512] if reason else None)

    # -- birth, will, commands ----------------------------------------------------------------------

    def _state(self, state: str, reason: str | None = None) -> bytes:
        return State(
            device_id=self.identity.device_id,
            state=state,
            session=self.spool.session,
            boot_id=self.identity.boot_id,
            version=self.version,
            at_wall=self.wall(),
            reason=reason,
        ).to_json()

    def _birth(self) -> list[Outgoing]:
        msgs = [Outgoing(self.link.topic("state"), self._state(*self._state_now), retain=True)]
        tiers = {k: list(v) for k, v in self.target.tiers().items()} if self.target else {}
        self._meta_engines = dict(self.target.reported().get("engine_hashes", {})) if self.target else {}
        meta = Meta(
            device_id=self.identity.device_id,
            version=self.version,
            capabilities=self.capabilities,
            tiers=tiers,
            schemas=dict(SCHEMA_VERSIONS),
            histogram_relative_error=relative_error(NOMINAL_SCALE),
            engines=dict(self._meta_engines),
            warnings=list(self.warnings),
            calibration_capture=self.calibration_capture,
            inventory=self._inventory(),
        )
        msgs.append(Outgoing(self.link.topic("meta"), meta.to_json(), retain=True))
        if self.commands:
            msgs.append(
                Outgoing(self.link.topic("reported"), self._reported_payload(self.commands.reported()), retain=True)
            )
        return msgs

    def _inventory(self) -> Inventory | None:
        if self.inventory is None:
            return None
        try:
            return self.inventory.model()
        except ValueError:  # an odd probe finding must never cost the birth messages: meta goes without it
            log.warning("the inventory is not valid; meta is published without it", exc_info=True)
            return None

    def update_inventory(self, **parts: Any) -> bool:
        """New probe findings or serving engines (``InventoryBook.update``'s keywords): ``meta`` is
        republished, retained, when the inventory or the engine hashes changed."""
        changed = self.inventory.update(**parts) if self.inventory is not None else False
        engines = dict(self.target.reported().get("engine_hashes", {})) if self.target else {}
        changed = changed or engines != self._meta_engines
        if changed:
            self.publish_meta()
        return changed

    def publish_meta(self) -> None:
        """Publish ``meta`` now, retained (the birth message, again, with what is known now)."""
        for msg in self._birth():
            if msg.topic == self.link.topic("meta"):
                self.link.publish(msg.topic, msg.payload, qos=1, retain=True)

    def _reported_payload(self, doc: dict[str, Any]) -> bytes:
        return Reported(device_id=self.identity.device_id, at_wall=self.wall(), **doc).to_json()

    def _publish_reported(self, doc: dict[str, Any]) -> None:
        self.link.publish(self.link.topic("reported"), self._reported_payload(doc), qos=1, retain=True)

    def _respond(self, topic: str, body: bytes, correlation: bytes | None) -> None:
        self.link.publish(topic, body, qos=1, retain=False, properties=response_properties(correlation))

    def _on_message(self, msg: Incoming) -> None:
        if self.discovery.handles(msg.topic):
            self.discovery.on_select(msg)
        elif self.commands is not None:
            self.commands.submit(msg)

    def _submit_command(self, msg: Incoming) -> None:
        if self.commands is not None:
            self.commands.submit(msg)

    def _birth_with_discovery(self) -> list[Outgoing]:
        tiers = self.target.tiers() if self.target else {}
        return self._birth() + self.discovery.birth(tiers or {w: [] for w in self.capabilities})

    def stats(self) -> dict[str, Any]:
        return {
            "spool": self.spool.stats(),
            "publisher": dict(self.publisher.stats),
            "link": {
                "connected": self.link.connected.is_set(),
                "connects": self.link.connects,
                "disconnects": self.link.disconnects,
                "callback_errors": self.link.callback_errors,
                "last_error": self.link.last_error,
            },
            "commands": dict(self.commands.stats) if self.commands else None,
            "window_overflow": self.accumulator.overflow,
            "max_buckets": DEFAULT_MAX_SIZE,
        }
