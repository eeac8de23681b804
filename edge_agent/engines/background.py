"""What each LLM tier serves, and the engine builds that run in the background while it serves.

``TierEngines.open`` resolves a tier (``resolve.py``: a verified cached engine, else the model
folder), opens it and records what the tier serves (``identities`` for ``reported.engine_hashes``).

A tier whose model has a recipe in ``engines.recipes_dir`` and no engine is *wanted*: with
``engines.build_on_start`` its build runs on one background thread (``engine-build``), after the
agent is serving, one recipe at a time. A build sends ``STATUS=`` lines with its step and
``engine_build`` events (``started`` → ``finished`` | ``refused`` | ``failed``); it never sends
``EXTEND_TIMEOUT_USEC`` (the service is already up: the extension would stretch ``RuntimeMaxSec``).
Only a build the start waits for (no tier could load without an engine) keeps systemd patient.
A build that passes the gate announces it: ``on_engine_ready(tier_name, engine_key)`` for each tier
that now has an engine; the app decides what to do (reload the serving tier onto it). The engines
never hold the ladder that serves them.

Stopping (``close``): a cancel flag the build checks before each step and at every sample makes it
give up within one sample's native work (``engine_build`` ``cancelled``; the finished steps stay
staged and resume next time, nothing half-built enters the cache); ``close`` then waits for the
build thread, up to a bound, so the interpreter never exits under a thread inside ONNX Runtime.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import EdgeAgentError, none_loaded
from ..models.llm import DecoderLM
from ..progress import Progress
from ..systemd import Notifier
from .cache import EngineCache, Entry
from .heartbeat import BuildCancelled, Heartbeat
from .pipeline import BuildRequest, GateRefused, Pipeline
from .plain_export_recipe import plain_export_recipe
from .recipes import TARGET_BACKENDS, Recipe
from .resolve import EngineResolver, Resolved, same_model, target_of
from .serving_mark import record_serving
from .stages import weight_only_unsupported

if TYPE_CHECKING:
    from ..config import EnginesConfig, TierConfig
    from ..models.recognizer import Recognizer

log = logging.getLogger(__name__)

BUILD_MODULES = ("onnx",)  # graph edits every backend's build needs (the [build] extra)

Event = Callable[[str, dict], None]
EngineReady = Callable[[str, str], None]  # (tier name, engine cache key)

__all__ = ["EngineReady", "Resolved", "TierEngines", "same_model", "target_of"]


class Startable(Protocol):
    """What ``build_then_start`` starts once an engine is built: a ladder's ``start(index)``."""

    def start(self, index: int) -> object: ...


@dataclass
class _Job:
    recipe: Recipe
    tiers: list[TierConfig]
    force: bool
    reason: str


class TierEngines:
    """The engine side of the agent's LLM tiers: open what each resolves to, build in the background,
    announce an engine that became ready (``on_engine_ready``)."""

    def __init__(
        self,
        engines: EnginesConfig,
        models_dir: Path,
        on_event: Event,
        notifier: Notifier,
        on_engine_ready: EngineReady | None = None,
    ) -> None:
        self.config, self.models_dir = engines, models_dir
        self.cache = EngineCache(engines.cache_dir, engines.max_bytes)
        self.on_event, self.notifier = on_event, notifier
        self.on_engine_ready = on_engine_ready
        self.resolver = EngineResolver(self.cache, models_dir, on_event, engines.recipes_dir)
        self.starting = True  # the service start waits on what we do: EXTEND_TIMEOUT_USEC is allowed
        self.serving_status = ""  # the READY status line, restored when a build ends
        self.served: dict[str, Resolved] = {}  # tier name -> what it loaded last
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()  # stopping: builds give up at their next step or sample

    # -- recipes ---------------------------------------------------------------------------------

    def all_recipes(self) -> list[Recipe]:
        return self.resolver.recipes()  # the user's folder, then the shipped recipes

    def recipe_for(self, tier: TierConfig) -> Recipe | None:
        """The first recipe that builds ``tier``'s model for its target and backend; without one, a plain
        Phi-3 / Gemma export gets its in-place FP32 recipe (``engines.convert_plain_exports``)."""
        found = next(
            (
                r
                for r in self.all_recipes()
                if r.workload == "llm"
                and same_model(r, tier.model)
                and target_of(tier) in r.targets
                and tier.backend in TARGET_BACKENDS[target_of(tier)]
            ),
            None,
        )
        if found is None and self.config.convert_plain_exports:
            return plain_export_recipe(tier)
        return found

    def recipes(self, tiers: Sequence[TierConfig]) -> list[str]:
        return list(dict.fromkeys(r.name for t in tiers if (r := self.recipe_for(t)) is not None))

    # -- resolve and open --------------------------------------------------------------------------

    def resolve(self, tier: TierConfig) -> Resolved:
        return self.resolver.resolve(tier)

    def open(self, tier: TierConfig, device_threads: int = 0) -> DecoderLM:
        """Resolve and open ``tier`` (the tier's ``Tier.open``); records what it serves."""
        resolved = self.resolve(tier)
        lm = self.resolver.open(resolved, tier, device_threads)
        self.served[tier.name] = resolved
        try:  # for `engines list`: a mark only, serving never depends on it
            record_serving(self.cache.root, tier.name, resolved.engine.key if resolved.engine else None)
        except OSError as exc:
            log.debug("could not record what tier %r serves in %s: %s", tier.name, self.cache.root, exc)
        return lm

    def open_recognizer(self, tier: TierConfig, device_threads: int = 0, **kwargs: Any) -> tuple[Recognizer, str]:
        """Resolve and open an ASR ``tier`` through the same cache: the recogniser and what it serves
        (``engine:KEY`` or ``model:HASH``); recorded like an LLM tier's."""
        resolved = self.resolve(tier)
        recognizer = self.resolver.open_recognizer(resolved, tier, device_threads, **kwargs)
        self.served[tier.name] = resolved
        return recognizer, resolved.identity

    def identities(self) -> dict[str, str]:
        return {name: r.identity for name, r in self.served.items()}

    # -- builds ----------------------------------------------------------------------------------

    def start_builds(self, tiers: Sequence[TierConfig]) -> list[dict[str, Any]]:
        """Queue one background build per recipe of the tiers that serve no engine (the worker skips a
        tier whose engine turns out to be cached)."""
        by_recipe: dict[str, tuple[Recipe, list[TierConfig]]] = {}
        for tier in tiers:
            recipe, served = self.recipe_for(tier), self.served.get(tier.name)
            if recipe is not None and not (served is not None and served.engine is not None):
                by_recipe.setdefault(recipe.name, (recipe, []))[1].append(tier)
        return [self.schedule(r, ts, False, "no engine cached at start") for r, ts in by_recipe.values()]

    def rebuild(self, name: str, tiers: Sequence[TierConfig]) -> dict[str, Any]:
        """The ``rebuild_engine`` command: build ``name`` again (forced) for the tiers it serves."""
        self.resolver.reread_recipes()  # the field engineer may have edited the recipe since the start
        mine = [t for t in tiers if (r := self.recipe_for(t)) is not None and r.name == name]
        if not mine:
            raise EdgeAgentError(
                f"no engine recipe {name!r} is configured for the LLM tiers on this device; "
                f"configured: {', '.join(self.recipes(tiers)) or '(none)'}"
            )
        recipe = self.recipe_for(mine[0])
        assert recipe is not None
        return self.schedule(recipe, mine, True, "rebuild_engine command")

    def schedule(self, recipe: Recipe, tiers: Sequence[TierConfig], force: bool, reason: str) -> dict[str, Any]:
        """Queue a background build of ``recipe`` for ``tiers``; returns at once. Without the build
        tooling (a core install, no ``[build]`` extra) nothing is queued: one ``engine_build`` event
        and one log line say why, and the model folder keeps serving."""
        missing = [m for m in BUILD_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            why = (
                f"engine building is not installed ({', '.join(missing)} missing): "
                "pip install 'edge-agent[build]'; the model folder serves meanwhile"
            )
            log.warning("engine build %s skipped: %s", recipe.name, why)
            self.on_event(
                "engine_build",
                {
                    "workload": "llm",
                    "recipe": recipe.name,
                    "tiers": [t.name for t in tiers],
                    "state": "failed",
                    "reason": reason,
                    "error": why,
                },
            )
            return {"recipe": recipe.name, "state": f"skipped: {why}", "tiers": [t.name for t in tiers]}
        with self._lock:
            if self._cancel.is_set():
                return {
                    "recipe": recipe.name,
                    "state": "refused: the agent is stopping",
                    "tiers": [t.name for t in tiers],
                }
            if recipe.name in self._pending:
                return {"recipe": recipe.name, "state": "already queued or running", "tiers": [t.name for t in tiers]}
            self._pending.add(recipe.name)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="engine-build", daemon=True)
                self._worker.start()
            position = self._jobs.qsize()
        self._jobs.put(_Job(recipe, list(tiers), force, reason))
        return {
            "recipe": recipe.name,
            "state": "started" if position == 0 else "queued",
            "tiers": [t.name for t in tiers],
        }

    def build_now(self, tier: TierConfig) -> bool:
        """Build ``tier``'s engine in the foreground (the start waits for it), keeping systemd patient."""
        recipe = self.recipe_for(tier)
        if recipe is None:
            return False
        return self._build(
            _Job(recipe, [tier], False, "no tier could load without an engine"),
            Heartbeat(enabled=False, notifier=self.notifier, cancel=self._cancel),
        )

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait for queued builds to finish (tests, stop); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def cancel(self) -> None:
        """Stop building: a running build gives up at its next step or sample; queued ones never start."""
        self._cancel.set()

    @property
    def building(self) -> bool:
        worker = self._worker
        return worker is not None and worker.is_alive()

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Cancel builds and wait up to ``timeout_s`` for the build thread; False if it still runs
        (a step inside native code that has no progress callback, e.g. a TensorRT plan)."""
        self.cancel()
        self._jobs.put(None)
        worker = self._worker
        if worker is None or worker is threading.current_thread():
            return True
        worker.join(timeout_s)
        return not worker.is_alive()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._cancel.is_set():  # stopping: drop what is queued
                with self._lock:
                    self._pending.discard(job.recipe.name)
                continue
            try:
                if not job.force:  # a tier not loaded yet may already have its engine cached
                    job.tiers = [t for t in job.tiers if self._engine_for(t) is None]
                if job.tiers:
                    self._build(
                        job, _StatusHeartbeat(self.notifier, f"building engine {job.recipe.name}", self._cancel)
                    )
            except Exception:  # the build thread must survive anything a build throws
                log.exception("engine build of %s crashed", job.recipe.name)
            finally:
                with self._lock:
                    self._pending.discard(job.recipe.name)

    def _build(self, job: _Job, heartbeat: Heartbeat) -> bool:
        """Build every precision the tiers ask for; True when a tier now has an engine to serve."""
        recipe = job.recipe
        pipe = Pipeline(recipe, self.cache, self.models_dir, self.config.build_threads, heartbeat)
        requests = []
        for tier in job.tiers:
            precisions = (
                [p for p in recipe.precisions if not weight_only_unsupported(tier.backend, p)]
                if tier.precision == "auto"
                else [tier.precision]
            )
            requests += [BuildRequest(target_of(tier), p, tier.backend, force=job.force) for p in precisions]
        base = {"workload": "llm", "recipe": recipe.name, "tiers": [t.name for t in job.tiers]}
        self.on_event(
            "engine_build",
            {**base, "state": "started", "reason": job.reason, "precisions": [r.precision for r in requests]},
        )
        t0 = time.perf_counter()
        built: list[dict] = []
        refused: list[str] = []
        failed: list[str] = []
        cancelled = False
        for i, req in enumerate(requests, 1):
            label = f"{req.backend}/{req.precision} ({i}/{len(requests)})"
            if isinstance(heartbeat, _StatusHeartbeat):
                heartbeat.prefix = f"building engine {recipe.name} {label}"
            self._status(f"building engine {recipe.name} {label}")
            try:
                heartbeat.check()
                report = pipe.build(req)
                built.append({"key": report["key"], "precision": req.precision, "cache": report.get("cache")})
            except BuildCancelled:
                cancelled = True
                log.info(
                    "engine build %s %s cancelled: the agent is stopping (finished steps stay staged)",
                    recipe.name,
                    label,
                )
                break
            except GateRefused as exc:
                refused.append(f"{req.precision}: {exc}")
            except EdgeAgentError as exc:  # missing runtime, bad data: said in one line, keep serving
                log.error("engine build %s %s failed: %s", recipe.name, label, exc)
                failed.append(f"{req.precision}: {exc}")
            except Exception as exc:  # a crash in a converter: the traceback is worth having
                log.exception("engine build %s %s failed", recipe.name, label)
                failed.append(f"{req.precision}: {exc if isinstance(exc, EdgeAgentError) else repr(exc)}")
        seconds = round(time.perf_counter() - t0, 2)
        if cancelled:
            self.on_event(
                "engine_build",
                {**base, "state": "cancelled", "build_s": seconds, "built": built, "reason": "the agent is stopping"},
            )
            return False
        ready = {t.name: e.key for t in job.tiers if (e := self._engine_for(t)) is not None}
        state = "finished" if ready else ("refused" if refused and not failed else "failed")
        payload = {**base, "state": state, "build_s": seconds, "built": built, "engines": ready}
        if refused or failed:
            payload["problems"] = refused + failed
        if not ready:
            payload["serving"] = "the model folder (no engine passed the build and the accuracy gate)"
        self.on_event("engine_build", payload)
        self._status(self.serving_status if not ready else f"{self.serving_status}; engine {recipe.name} ready")
        for tier in job.tiers:
            if tier.name in ready and not self._cancel.is_set() and self.on_engine_ready is not None:
                self.on_engine_ready(tier.name, ready[tier.name])
        return bool(ready)

    def build_then_start(self, ladder: Startable, tiers: Sequence[TierConfig], errors: list[tuple[str, str]]) -> None:
        """No tier loads without an engine (TensorRT tiers on a fresh Jetson): build the lightest one that
        has a recipe while the start waits (the build sends EXTEND_TIMEOUT_USEC), then serve it."""
        for index in reversed(range(len(tiers))):
            tier = tiers[index]
            if not self.config.build_on_start or self.recipe_for(tier) is None:
                continue
            self.notifier.status(f"starting: no LLM tier loads without an engine; building {tier.name}'s")
            if self.build_now(tier):
                try:
                    ladder.start(index)
                    return
                except EdgeAgentError as exc:
                    errors.append((f"{tier.name} (built engine)", str(exc)))
        raise none_loaded("LLM", errors)

    def _engine_for(self, tier: TierConfig) -> Entry | None:
        try:
            return self.resolve(tier).engine
        except EdgeAgentError:
            return None

    def _status(self, text: str) -> None:
        if text:
            self.notifier.status(text[:200])


class _StatusHeartbeat(Heartbeat):
    """A background build's progress: ``STATUS=`` lines at most every 5 s; never EXTEND_TIMEOUT_USEC."""

    def __init__(self, notifier: Notifier, prefix: str, cancel: threading.Event | None = None) -> None:
        # the silent notifier gets beat()'s extensions
        super().__init__(enabled=False, notifier=Notifier({}), cancel=cancel)
        self.prefix, self.status_notifier, self.last_status = prefix, notifier, float("-inf")

    def bar(self, label: str, unit: str = "") -> Progress:
        now = self.clock()
        if now - self.last_status >= 5.0:
            self.status_notifier.status(f"{self.prefix}: {label}"[:200])
            self.last_status = now
        return Progress(label, unit=unit, enabled=False)
