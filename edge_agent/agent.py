"""``edge-agent run``: the daemon, composed from config.

Concurrency model (the one place it is stated): threads, no sync/async twins.
- one device thread per loaded model: the LLM scheduler of the active tier (plus, during a switch,
  the tier being warmed and the one draining), and the ASR batcher;
- the local API runs its own asyncio loop on one thread and bridges to request handles;
- telemetry: paho's network thread, the publisher and the command worker; publishing goes through
  the disk spool and never blocks a device thread;
- the tier controller and the watchdog each tick on a thread of their own;
- the main thread waits for signals: SIGTERM/SIGINT drain and stop, SIGHUP reloads the config.

Start: config → telemetry (a missing broker is fine: the spool keeps everything) → models (the top
tier; a tier that cannot load falls back to the next lighter one) → controller → API → READY=1.
Stop: STOPPING=1, refuse new requests (503), drain in-flight ones within ``drain_s``, publish
``offline``, flush the spool.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from . import __version__
from .backends import SessionOptions
from .config import Settings, TierConfig, load_settings
from .errors import ConfigError, EdgeAgentError, ModelError
from .metrics.prometheus import PrometheusMetrics
from .metrics.timing import RequestTiming
from .models.catalog import resolve_model
from .models.llm import DecoderLM
from .serving.api import ApiServer
from .serving.scheduler import Limits
from .serving.tier_control import TierController, policy_from_config
from .serving.tiered import Tier, TieredLLM
from .systemd import LoopHeartbeat, Notifier, Watchdog

log = logging.getLogger(__name__)


class Agent:
    """Everything one device runs. Implements the telemetry ``CommandTarget`` seam."""

    def __init__(self, settings: Settings, config_path: str | None = None, notifier: Notifier | None = None,
                 drain_s: float = 30.0) -> None:
        self.settings, self.config_path = settings, config_path
        self.notifier = notifier or Notifier()
        self.drain_s = drain_s
        self.metrics = PrometheusMetrics()
        self.telemetry = None
        self.llm: TieredLLM | None = None
        self.controller: TierController | None = None
        self.api: ApiServer | None = None
        self.asr = None
        self.watchdog: Watchdog | None = None
        self._observers: dict[str, Callable[[RequestTiming], None]] = {}
        self.started_wall = time.time()

    # -- start / stop ---------------------------------------------------------------------------

    def start(self) -> Agent:
        s = self.settings
        self.notifier.status("starting: telemetry")
        self.telemetry = self._start_telemetry()
        self.notifier.status("starting: loading the LLM tier")
        self.llm = self._start_llm()
        self.notifier.status("starting: ASR")
        self.asr = self._start_asr()
        self.api = ApiServer(self.llm, self.metrics, s.api.token.get_secret_value() if s.api.token else None,
                             asr=self.asr, health=self.health).start(s.api.host, s.api.port,
                                                                    str(s.api.unix_socket) if s.api.unix_socket else None)
        self.metrics.track_load("llm", lambda: self.llm.load)
        heartbeats = [LoopHeartbeat(lambda: self.llm.steps, lambda: self.llm.load != (0, 0))]
        self.watchdog = Watchdog(self.notifier, lambda: all(h() for h in heartbeats)).start()
        status = f"serving: llm tier {self.llm.tiers[self.llm.active].name} ({self.llm.model_name})"
        if self.asr is not None:
            status += f", asr {self.asr.tier_name}"
        self._publish_reported()
        self.notifier.ready(f"{status}; api {self.api.address}")
        log.info("%s; api %s", status, self.api.address)
        return self

    def stop(self) -> None:
        self.notifier.stopping("draining in-flight requests")
        if self.api is not None:
            self.api.draining = True  # new requests get 503 + Retry-After while the rest finish
        if self.controller is not None:
            self.controller.stop()
        if self.llm is not None:
            self.llm.stop(self.drain_s)
        if self.asr is not None:
            self.asr.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.api is not None:
            self.api.stop()
        if self.telemetry is not None:
            self.notifier.status("stopping: flushing telemetry")
            self.telemetry.stop()

    def reload(self) -> str:
        """SIGHUP: validate the file first; keep the running config when it is wrong, and say why."""
        try:
            new = load_settings(self.config_path)
        except ConfigError as exc:
            message = f"reload refused, keeping the running config: {exc}"
            log.error("%s", message)
            self.notifier.status(message[:200])
            return message
        applied, restart = ["sla"], []
        if self.controller is not None:
            self.controller.policy = policy_from_config(new.sla, self.settings.batching.max_batch)
        for section in ("models", "mqtt", "api", "telemetry", "engines", "audio", "device", "batching"):
            if getattr(new, section) != getattr(self.settings, section):
                restart.append(section)
        self.settings = self.settings.model_copy(update={"sla": new.sla})
        message = f"reloaded: applied {', '.join(applied)}" + (
            f"; changes to {', '.join(restart)} take effect after a restart" if restart else "")
        log.info("%s", message)
        self.notifier.status(message[:200])
        return message

    # -- parts ----------------------------------------------------------------------------------

    def _start_telemetry(self):
        from .telemetry.service import Telemetry

        caps = ["llm"] + (["asr"] if self.settings.models.asr else [])
        return Telemetry(self.settings.mqtt, self.settings.telemetry, version=__version__, target=self,
                         capabilities=caps).start()

    def _start_llm(self) -> TieredLLM:
        s = self.settings
        tiers = [Tier(t.name, self._opener(t), self._limits(t), t.max_new_tokens) for t in s.models.llm]
        served = TieredLLM(tiers, on_finished=self._llm_finished, on_switched=self._llm_switched,
                           drain_s=self.drain_s)
        errors = []
        for index, tier in enumerate(tiers):  # the top tier, or the lightest one that loads
            try:
                served.start(index)
                break
            except EdgeAgentError as exc:
                errors.append(f"{tier.name}: {exc}")
                log.error("LLM tier %r could not load (%s); trying the next one", tier.name, exc)
                self._event("tier_load_failed", {"workload": "llm", "tier": tier.name, "error": str(exc)})
        else:
            raise ModelError("no LLM tier could be loaded: " + "; ".join(errors))
        policy = policy_from_config(s.sla, max(t.max_batch for t in s.models.llm))
        self.controller = TierController(served, policy, window_s=s.sla.window_s,
                                         evaluate_every_s=s.sla.evaluate_every_s, on_event=self._event).start()
        return served

    def _opener(self, tier: TierConfig) -> Callable[[], DecoderLM]:
        s = self.settings

        def open_tier() -> DecoderLM:
            # Generating demo weights or compiling can take a while: keep systemd patient.
            self.notifier.extend_timeout(300)
            ref = resolve_model(tier.model, s.models.cache_dir)
            options = SessionOptions(device=tier.device, threads=s.device.threads, precision=tier.precision,
                                     cache_dir=s.engines.cache_dir)
            return DecoderLM.open(ref, tier.backend, options)
        return open_tier

    def _limits(self, tier: TierConfig) -> Limits:
        b = self.settings.batching
        max_batch = min(tier.max_batch, b.max_batch)
        return Limits(max_batch=max_batch, batch_timeout_ms=b.batch_timeout_ms,
                      preferred_batch_sizes=tuple(x for x in b.preferred_batch_sizes if x <= max_batch),
                      max_queue=b.max_queue, queue_timeout_ms=b.queue_timeout_ms)

    def _start_asr(self):
        if not self.settings.models.asr:
            return None
        try:
            from .serving.speech import open_speech

            return open_speech(self.settings, on_utterance=self._asr_finished)
        except ImportError as exc:  # the audio extra (soundfile) is missing
            log.error("ASR is configured but cannot start: %s (pip install 'edge-agent[audio]')", exc)
            return None
        except EdgeAgentError as exc:  # speech is one workload; the LLM keeps serving without it
            log.error("ASR could not start: %s", exc)
            self._event("tier_load_failed", {"workload": "asr", "tier": self.settings.models.asr[0].name,
                                             "error": str(exc)})
            return None

    # -- hooks ----------------------------------------------------------------------------------

    def _llm_finished(self, timing: RequestTiming) -> None:
        self.metrics.observe(timing, "llm")
        if self.controller is not None:
            self.controller.observe(timing)
        if self.telemetry is not None:
            tier = next((t.split(":", 1)[1] for t in timing.tags if t.startswith("tier:")), "")
            observer = self._observers.get(tier)
            if observer is None:
                model = next((t.model for t in self.settings.models.llm if t.name == tier), "")
                observer = self._observers[tier] = self.telemetry.llm_observer(tier, model)
            observer(timing)

    def _asr_finished(self, tier: str, model: str, samples: dict[str, list[float]]) -> None:
        if self.telemetry is not None:
            self.telemetry.accumulator.observe("asr", tier, model, samples)
        for metric, histogram in (("first_partial_ms", self.metrics.asr_first_partial),
                                  ("final_ms", self.metrics.asr_final)):
            for value in samples.get(metric, ()):
                histogram.labels(tier).observe(value / 1e3)

    def _llm_switched(self, old: int, new: int, load_ms: float, error: str | None) -> None:
        if error and self.controller is not None:
            self.controller.switch_failed(old, new, error)
        else:
            self._publish_reported()

    def _publish_reported(self) -> None:
        """The retained ``reported`` state, after anything it shows changed (tiers, pins, SLA)."""
        if self.telemetry is not None and self.telemetry.commands is not None:
            commands = self.telemetry.commands
            commands.publish_reported(commands.reported())

    def _event(self, kind: str, payload: dict) -> None:
        log.info("event %s: %s", kind, payload)
        if self.telemetry is not None:
            self.telemetry.emit_event(kind, payload)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": __version__, "uptime_s": round(time.time() - self.started_wall, 1)}
        if self.telemetry is not None:
            out["mqtt_connected"] = self.telemetry.link.connected.is_set()
        return out

    # -- telemetry CommandTarget ------------------------------------------------------------------

    def tiers(self) -> dict[str, list[str]]:
        return {w: [t.name for t in getattr(self.settings.models, w)] for w in ("llm", "asr")
                if getattr(self.settings.models, w)}

    def recipes(self) -> list[str]:
        return []  # engine recipes arrive with `edge-agent build`; none are configured yet

    def status(self) -> dict[str, Any]:
        out = {**self.health(), **self.reported()}
        if self.llm is not None:
            waiting, running = self.llm.load
            out["llm_load"] = {"waiting": waiting, "running": running}
        if self.controller is not None and self.controller.last is not None:
            out["llm_controller"] = {"action": self.controller.last.action, "reason": self.controller.last.reason}
        return out

    def set_sla(self, workload: str, sla) -> dict[str, Any]:
        if workload != "llm" or self.controller is None:
            raise EdgeAgentError(f"no SLA controller for workload {workload!r} on this device")
        self.controller.policy = replace(self.controller.policy, metric=sla.metric, percentile=sla.percentile,
                                         target_ms=sla.target_ms, min_samples=sla.min_samples)
        self.controller.window_s = sla.window_s
        return {"sla": sla.model_dump()}

    def pin_tier(self, workload: str, tier: str) -> dict[str, Any]:
        if workload != "llm" or self.controller is None:
            raise EdgeAgentError(f"no tier controller for workload {workload!r} on this device")
        self.controller.pin(tier)
        self._publish_reported()
        return {"pinned": tier}

    def unpin_tier(self, workload: str) -> dict[str, Any]:
        if workload == "llm" and self.controller is not None:
            self.controller.unpin()
        return {"pinned": None}

    def rebuild_engine(self, recipe: str) -> dict[str, Any]:
        raise EdgeAgentError(f"no engine recipe {recipe!r} is configured on this device")

    def flush_telemetry(self) -> dict[str, Any]:
        if self.telemetry is not None:
            self.telemetry.publisher.flush()
        return {"flushed": True}

    def reported(self) -> dict[str, Any]:
        out: dict[str, Any] = {"active_tiers": {}, "pins": {}, "sla": {}, "engine_hashes": {}}
        if self.llm is not None and self.llm.active_tier is not None:
            out["active_tiers"]["llm"] = self.llm.active_tier
        if self.asr is not None:
            out["active_tiers"]["asr"] = self.asr.tier_name
        if self.controller is not None:
            p = self.controller.policy
            if self.controller.state.pinned is not None:
                out["pins"]["llm"] = self.llm.tiers[self.controller.state.pinned].name
            out["sla"]["llm"] = {"metric": p.metric, "percentile": p.percentile, "target_ms": p.target_ms,
                                 "window_s": self.controller.window_s, "min_samples": p.min_samples}
        return out


def run(config: str | None) -> int:
    settings = load_settings(config)
    agent = Agent(settings, config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=agent.reload, daemon=True).start())
    try:
        agent.start()
    except BaseException:
        agent.stop()
        raise
    stop.wait()
    log.info("stopping: draining")
    agent.stop()
    return 0


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the daemon (as systemd does): serve, measure, report, switch tiers")
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    p.set_defaults(func=lambda args: _run_cli(args))


def _run_cli(args: argparse.Namespace) -> int:
    logging.getLogger("edge_agent").setLevel(logging.DEBUG if args.debug else logging.INFO)
    logging.getLogger().setLevel(logging.DEBUG if args.debug else logging.INFO)
    return run(args.config)

