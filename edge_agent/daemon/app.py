"""The daemon's parts, composed from config (``Agent``: start, drain and stop, reload); the process
around it (the state lock, signals, the exit) is ``cli/run.py``, the fleet's view ``remote.py``.

Concurrency model (the one place it is stated): threads, no sync/async twins.
- one device thread per loaded model: the LLM scheduler of the active tier (plus, during a switch,
  the tier being warmed and the one draining), and the ASR batcher;
- the local API runs its own asyncio loop on one thread and bridges to request handles;
- telemetry: paho's network thread, the publisher and the command worker; publishing goes through
  the disk spool and never blocks a device thread;
- the tier controller and the watchdog each tick on a thread of their own;
- the main thread waits for signals (``cli/run.py``): SIGTERM/SIGINT drain and stop, SIGHUP reloads.

Start: config → telemetry (a missing broker is fine: the spool keeps everything) → models (the top
tier; a tier that cannot load falls back to the next lighter one) → controller → API → READY=1.
Stop: STOPPING=1, refuse new requests (503), drain in-flight ones within ``drain_s``, publish
``offline``, flush the spool.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..config import Settings, TierConfig
from ..diagnostics.preflight import prefix_cache_problems
from ..errors import ConfigError, EdgeAgentError
from ..metrics.prometheus import PrometheusMetrics
from ..models.llm import DecoderLM
from ..observe import Observers
from ..serving.capture import Capture
from ..serving.doors.http.server import ApiServer
from ..serving.doors.voice.turn import turn_options
from ..serving.llm.tiers import TieredLLM
from ..serving.tiers.control import TierController
from ..serving.tiers.policy import policy_from_config
from ..systemd import LoopHeartbeat, Notifier, Watchdog
from ..telemetry.health import HealthReader
from ..telemetry.inventory import InventoryBook, config_digest
from .reload import reload as reload_config
from .remote import RemoteTarget
from .serving_inventory import InventoryFeed

if TYPE_CHECKING:
    from ..engines.background import TierEngines
    from ..engines.resolve import Resolved
    from ..serving.doors.wyoming.server import WyomingServer
    from ..telemetry.service import Telemetry

log = logging.getLogger(__name__)


class Agent:
    """Everything one device runs, composed from ``Settings``: ``start``, ``stop`` (drain), ``reload``.
    The fleet steers it through ``remote`` (``remote.RemoteTarget``, the telemetry ``CommandTarget``)."""

    def __init__(
        self,
        settings: Settings,
        config_path: str | None = None,
        notifier: Notifier | None = None,
        drain_s: float = 30.0,
    ) -> None:
        self.settings, self.config_path = settings, config_path
        self.notifier = notifier or Notifier()
        self.drain_s = drain_s
        self.metrics = PrometheusMetrics()
        self.telemetry: Telemetry | None = None
        self.llm: TieredLLM | None = None
        self.controller: TierController | None = None
        self.api: ApiServer | None = None
        self.asr = None
        self.asr_controller: TierController | None = None  # only with two or more ASR tiers
        self.capture: Capture | None = None  # [calibration] capture, when capture_dir is set
        self.wyoming: WyomingServer | None = None  # [wyoming] enabled: Home Assistant's voice pipeline
        self._engines: TierEngines | None = None  # made on first use
        self.watchdog: Watchdog | None = None
        # Every finished request and utterance, to Prometheus, the controllers and the telemetry.
        self.observers = Observers()
        self.observers.register(self.metrics.observe)
        self.started_wall = time.time()
        self.remote = RemoteTarget(self)
        self.inventory = InventoryFeed(self)

    # -- start / stop ---------------------------------------------------------------------------

    def start(self) -> Agent:
        s = self.settings
        problems = prefix_cache_problems(s)  # a bound that could cache nothing is refused before anything starts
        if problems:
            raise ConfigError(problems)
        engines = self.tier_engines()
        self.notifier.status("starting: telemetry")
        self.telemetry = self._start_telemetry()
        if self.telemetry is not None:
            self.observers.register(self.telemetry.observe)
        self.notifier.status("starting: loading the LLM tier")
        self.llm = self._start_llm()
        self.notifier.status("starting: ASR")
        self.asr = self._start_asr()
        self.capture = self._start_capture()
        if self.telemetry is not None and self.telemetry.commands is not None:
            # Before the API listens: a restarted device never serves under the file's SLA while the
            # ledger holds a desired the fleet applied.
            self.telemetry.commands.restore_desired()
        unix_socket = str(s.api.unix_socket) if s.api.unix_socket else None
        self.api = ApiServer(
            self.llm,
            self.metrics,
            s.api.token.get_secret_value() if s.api.token else None,
            asr=self.asr,
            health=self.health,
            cors_origins=s.api.cors_origins,
            voice_options=turn_options(s.audio),
        ).start(s.api.host, s.api.port, unix_socket)
        self.wyoming = self._start_wyoming()
        llm, api, wyoming = self.llm, self.api, self.wyoming
        self.metrics.track_load("llm", lambda: llm.load)
        heartbeats = [
            LoopHeartbeat(lambda: llm.steps, lambda: llm.load != (0, 0)),
            LoopHeartbeat(lambda: api.ticks, lambda: True),
        ]  # the API loop never blocks
        if wyoming is not None:  # nor does the Wyoming server's
            heartbeats.append(LoopHeartbeat(lambda: wyoming.ticks, lambda: True))
        self.watchdog = Watchdog(self.notifier, lambda: all(h() for h in heartbeats)).start()
        status = f"serving: llm tier {self.llm.tiers[self.llm.active].name} ({self.llm.model_name})"
        if self.asr is not None:
            status += f", asr {self.asr.active_tier}"
        self.remote.publish_reported()
        self.metrics.track_health(HealthReader().snapshot)
        self.notifier.ready(f"{status}; api {self.api.address}")
        log.info("%s; api %s", status, self.api.address)
        engines.starting, engines.serving_status = False, f"{status}; api {self.api.address}"
        self.inventory.changed()
        # Accelerator probes load drivers in child processes (seconds; a TensorRT probe can crash its
        # child): after READY, on a thread, then meta is republished with what they found.
        threading.Thread(target=self.inventory.probe, name="inventory", daemon=True).start()
        if s.engines.build_on_start and not self._stop_requested:  # serving: missing engines build in the background
            for job in engines.start_builds(s.models.llm):
                log.info("engine build %s %s for tier(s) %s", job["recipe"], job["state"], ", ".join(job["tiers"]))
        return self

    _stop_requested = False  # SIGTERM came: start schedules no build, a running one gives up
    build_stop_s = 20.0  # how long stop waits for a build's native step (TimeoutStopSec=60 covers drain + this)

    def cancel_builds(self) -> None:
        """Stopping: a running engine build gives up at its next step or sample; none starts any more.
        Safe from a signal handler (it only sets flags)."""
        self._stop_requested = True
        if self._engines is not None:
            self._engines.cancel()

    def stop(self) -> bool:
        """Drain and stop everything; False when a build thread is still inside native code after
        ``build_stop_s`` (the caller must then leave with ``os._exit``: interpreter teardown under a
        thread inside ONNX Runtime/OpenVINO aborts the process)."""
        self.cancel_builds()  # first, so the build winds down while requests drain
        self.notifier.stopping("draining in-flight requests")
        if self.api is not None:
            self.api.draining = True  # new requests get 503 + Retry-After while the rest finish
        if self.wyoming is not None:
            self.wyoming.draining = True  # new connections are closed; open ones finish within the drain
        for controller in (self.controller, self.asr_controller):
            if controller is not None:
                controller.stop()
        # Both workloads drain at once, so the whole stop stays within drain_s + build_stop_s
        # (TimeoutStopSec=60 in the unit), however many requests and streams are in flight.
        drains = [
            threading.Thread(target=served.stop, args=(self.drain_s,), name=f"drain-{name}")
            for name, served in (("llm", self.llm), ("asr", self.asr))
            if served is not None
        ]
        for thread in drains:
            thread.start()
        for thread in drains:
            thread.join()
        finished = True
        if self._engines is not None:  # a cancelled build keeps its finished steps staged; they resume next time
            finished = self._engines.close(self.build_stop_s)
            if not finished:
                log.warning(
                    "the engine build did not stop within %.0f s (a native step); leaving it unfinished "
                    "(nothing half-built is in the cache)",
                    self.build_stop_s,
                )
        if self.capture is not None:  # after the drains: what they captured is written
            self.capture.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.api is not None:
            self.api.stop()
        if self.wyoming is not None:
            self.wyoming.stop()
        if self.telemetry is not None:
            self.notifier.status("stopping: flushing telemetry")
            self.telemetry.stop()
        return finished

    def reload(self) -> str:
        """SIGHUP: validate the file first; keep the running config when it is wrong, and say why. The
        file's SLA applies, then the fleet's stored ``desired`` on top of it (it overlays the file);
        a ``set_sla`` command's SLA gives way to them. ``reported`` is republished either way."""
        return reload_config(self)

    # -- parts ----------------------------------------------------------------------------------

    def _start_telemetry(self):
        from ..telemetry.admission import prometheus_totals
        from ..telemetry.service import Telemetry

        caps = ["llm"] + (["asr"] if self.settings.models.asr else [])
        book = InventoryBook(__version__, config_digest(self.settings))
        telemetry = Telemetry(
            self.settings.mqtt,
            self.settings.telemetry,
            version=__version__,
            target=self.remote,
            capabilities=caps,
            inventory=book,
            admission=functools.partial(prometheus_totals, self.metrics),  # refusals, preemptions per window
        )
        telemetry.calibration_capture = self.settings.calibration.summary()  # meta says whether it is on
        return telemetry.start()

    def _start_wyoming(self) -> WyomingServer | None:
        """[wyoming] enabled: the Wyoming server on the same ladders as the HTTP API (docs/wyoming.md)."""
        cfg = self.settings.wyoming
        if not cfg.enabled:
            return None
        from ..serving.doors.wyoming.server import WyomingServer

        return WyomingServer(cfg, self.asr, self.llm, self.metrics.wyoming_request, __version__).start()

    def _start_capture(self) -> Capture | None:
        """[calibration] capture, when configured: the LLM ladder and the ASR tiers tell it their traffic."""
        c = self.settings.calibration
        if c.capture_dir is None or not (c.capture_llm or c.capture_asr):
            return None
        try:
            capture = Capture(
                c.capture_dir, c.capture_rate, c.max_items, c.max_bytes, llm=c.capture_llm, asr=c.capture_asr
            ).start()
        except OSError as exc:  # an unwritable capture directory must not stop serving
            log.error("calibration capture is off: cannot use %s (%s)", c.capture_dir, exc.strerror or exc)
            return None
        if self.llm is not None and c.capture_llm:
            self.llm.capture = capture.llm
        if self.asr is not None and c.capture_asr:
            self.asr.set_capture(capture.asr)
        log.info("calibration capture %s", c.summary())
        return capture

    def _start_llm(self) -> TieredLLM:
        s = self.settings
        served = TieredLLM.from_config(
            s.models,
            s.batching,
            s.prefix_cache,
            s.sla.target_ms,
            self._open_model,
            self._weights,  # equal: one loaded model for both
            self.inventory.engine_identity,
            observe=self.observers.deliver,
            on_switched=functools.partial(self._switched, "llm"),
            drain_s=self.drain_s,
        )
        policy = policy_from_config(s.sla, max(t.rows(s.batching) for t in s.models.llm))
        # A one-sequence tier (the NPU) spills what would miss the SLA in force: read at each decision, so
        # a reload, a set_sla and a desired (all through the controller's set_policy) change it at once.
        served.spill_threshold = lambda: (
            (self.controller.policy if self.controller is not None else policy).spill_threshold_ms
        )
        # One live SLA: admission's chat budget and the adaptive batch wait read the policy in force.
        served.sla_ms = served.spill_threshold
        served.on_preempted = lambda: self.metrics.preemptions.labels("llm").inc()
        for t in s.models.llm:  # each tier's prefix cache, in /metrics while the tier is loaded
            self.metrics.track_prefix_cache(t.name, functools.partial(served.prefix_stats, t.name))
        errors = served.start_first(
            lambda tier, exc: self._event("tier_load_failed", {"workload": "llm", "tier": tier, "error": str(exc)})
        )
        if served.active_tier is None:  # no tier loads: build an engine for one, then serve it
            self.tier_engines().build_then_start(served, s.models.llm, errors)
        self.controller = TierController(
            served,
            policy,
            window_s=s.sla.window_s,
            evaluate_every_s=s.sla.evaluate_every_s,
            on_event=self._event,
            temperature=HealthReader().max_temp_c,
            pressure=served.pressure,
        ).start()
        served.on_pressure = self.controller.poke
        self.observers.register(self.controller.observe)
        return served

    def _open_model(self, tier: TierConfig) -> DecoderLM:
        engines = self.tier_engines()
        if engines.starting:  # demo weights, hashing, compiling: keep systemd patient (not once serving)
            self.notifier.extend_timeout(300)
        # the cached engine if current and intact, else the folder
        return engines.open(tier, self.settings.device.threads)

    def _open_recognizer(self, tier: TierConfig, **kwargs: Any):  # -> tuple[Recognizer, str]
        """An ASR tier through the same engine cache as the LLM's (a gated Whisper engine, else the folder)."""
        return self.tier_engines().open_recognizer(tier, self.settings.device.threads, **kwargs)

    def _weights(self, tier: TierConfig) -> str:
        """What ``tier`` would load, as the ladder compares it (tiers with equal weights share one model):
        the engine the resolver picks now (a lower rung with no engine of its own picks the top rung's), else
        its model folder with its runtime settings. A model not here yet: its name (the load says why)."""
        try:
            return self.tier_engines().resolver.weights(tier)
        except (EdgeAgentError, OSError):
            return f"{tier.model}|{tier.backend}|{tier.device}|{tier.precision}"

    def _start_asr(self):
        """The ASR ladder from its top tier (or the first lighter one that loads), and its controller
        when there are tiers to switch between."""
        s = self.settings
        if not s.models.asr:
            return None
        try:
            from ..serving.asr.tiers import open_speech

            speech = open_speech(
                s,
                open_tier=functools.partial(self._open_recognizer, final_padding_s=s.asr.final_padding_s),
                observe=self.observers.deliver,
                on_switched=functools.partial(self._switched, "asr"),
                on_load_failed=lambda tier, exc: self._event(
                    "tier_load_failed", {"workload": "asr", "tier": tier, "error": str(exc)}
                ),
                drain_s=self.drain_s,
            )
        except ImportError as exc:  # the audio extra (soundfile) is missing
            log.error("ASR is configured but cannot start: %s (pip install 'edge-agent[audio]')", exc)
            return None
        except EdgeAgentError as exc:  # speech is one workload; the LLM keeps serving without it
            log.error("ASR could not start: %s", exc)
            return None
        # One live SLA: every tier's adaptive batch wait reads the ASR policy in force (the controller's, which
        # reload, set_sla and desired change; with one tier, the file's as last reloaded)
        speech.set_sla(lambda: self._asr_policy().target_ms)
        if len(speech.tiers) > 1:
            self.asr_controller = TierController(
                speech,
                policy_from_config(s.sla.asr),
                window_s=s.sla.asr.window_s,
                evaluate_every_s=s.sla.asr.evaluate_every_s,
                on_event=self._event,
                workload="asr",
            ).start()
            self.observers.register(self.asr_controller.observe)
        return speech

    def _asr_policy(self):  # -> Policy
        """The ASR SLA in force: its controller's (reload, set_sla, desired), else the file's as last reloaded."""
        return (
            self.asr_controller.policy if self.asr_controller is not None else policy_from_config(self.settings.sla.asr)
        )

    def tier_engines(self) -> TierEngines:
        """What each LLM tier loads (cached engine or model folder) and the background engine builds."""
        if self._engines is None:
            from ..engines.background import TierEngines
            from ..serving.tiers.engine_swap import swap_onto_engine

            def engine_ready(tier: str, _key: str) -> None:  # a passing background build: serve its engine
                swap_onto_engine(self.llm, tier, made.served.get, self._event)
                self.inventory.changed()

            made = self._engines = TierEngines(
                self.settings.engines,
                self.settings.models.cache_dir,
                self._event,
                self.notifier,
                on_engine_ready=engine_ready,
            )
        return self._engines

    # -- hooks ----------------------------------------------------------------------------------

    def _switched(self, workload: str, old: int, new: int, load_ms: float, error: str | None) -> None:
        """A ladder's switch ended: a failure goes to its controller, a success to ``reported`` and ``meta``."""
        controller = self.controller if workload == "llm" else self.asr_controller
        if error and controller is not None:
            controller.switch_failed(old, new, error)
        else:
            self.remote.publish_reported()
            self.inventory.changed()

    def served_engines(self) -> dict[str, Resolved]:
        """Per LLM tier loaded so far: the engine (or model folder) it serves."""
        return dict(self._engines.served) if self._engines is not None else {}

    @property
    def stopping(self) -> bool:
        """SIGTERM came: no new build starts, and nothing new is published about the device."""
        return self._stop_requested

    def _event(self, kind: str, payload: dict) -> None:
        log.info("event %s: %s", kind, payload)
        if self.telemetry is not None:
            self.telemetry.emit_event(kind, payload)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": __version__, "uptime_s": round(time.time() - self.started_wall, 1)}
        if self.telemetry is not None:
            out["mqtt_connected"] = self.telemetry.link.connected.is_set()
        return out
