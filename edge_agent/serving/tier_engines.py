"""What each LLM tier loads at start (a cached engine, else its model folder), and background builds.

For a tier (model, backend, device, precision) ``resolve`` picks the engine the accuracy gate would
choose among the *current* cache entries of that model: same runtime version and device
fingerprint, and built from the same model bytes (the entry's ``key_parts.model`` equals the
folder's hash, so an edited export never serves an engine of the old one). Every candidate is
re-hashed before use; a corrupt one is quarantined, reported (``engine_quarantined``) and the next
one, or the plain model folder, is served: a bad cache never stops a start.

A tier whose model has a recipe in ``engines.recipes_dir`` and no engine is *wanted*: with
``engines.build_on_start`` its build runs on one background thread (``engine-build``), after the
agent is serving, one recipe at a time. A build sends ``STATUS=`` lines with its step and
``engine_build`` events (``started`` → ``finished`` | ``refused`` | ``failed``); it never sends
``EXTEND_TIMEOUT_USEC`` (the service is already up: the extension would stretch ``RuntimeMaxSec``).
Only a build the start waits for (no tier could load without an engine) keeps systemd patient.

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..backends import SessionOptions, open_session
from ..engines.cache import EngineCache, Entry, hash_model
from ..engines.pipeline import BuildCancelled, BuildRequest, GateRefused, Heartbeat, Pipeline
from ..engines.recipes import TARGET_BACKENDS, Recipe, load_recipe, recipe_files
from ..errors import ConfigError, EdgeAgentError, ModelError
from ..models.catalog import DEMO_MODELS, ModelRef, inspect_folder, resolve_model
from ..models.llm import DecoderLM
from ..progress import Progress
from ..systemd import Notifier

if TYPE_CHECKING:
    from ..config import EnginesConfig, TierConfig
    from .tiered import TieredLLM

log = logging.getLogger(__name__)

BUILD_MODULES = ("onnx",)  # graph edits every backend's build needs (the [build] extra)

Event = Callable[[str, dict], None]


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a tier loads: ``engine`` (a verified cache entry) or, when None, the model folder ``source``."""

    tier: str
    source: ModelRef
    model_hash: str
    engine: Entry | None = None
    why_plain: str = ""  # why no engine is served (empty when one is)

    @property
    def identity(self) -> str:
        """For ``reported.engine_hashes``: the cache key of the engine, or the model folder's hash."""
        return f"engine:{self.engine.key}" if self.engine else f"model:{self.model_hash}"

    @property
    def ref(self) -> ModelRef:
        return inspect_folder(self.engine.artifact, name=self.source.name) if self.engine else self.source


def target_of(tier: TierConfig) -> str:
    """The build target (recipe vocabulary) of a serving tier."""
    if tier.backend == "tensorrt":
        return "jetson"
    if tier.backend == "openvino" and tier.device.upper().startswith("NPU"):
        return "intel-npu"
    return "cpu"


def same_model(recipe: Recipe, model: str) -> bool:
    if model in DEMO_MODELS or recipe.model in DEMO_MODELS:
        return model == recipe.model
    return recipe.resolve(recipe.model).resolve() == Path(model).expanduser().resolve()


@dataclass
class _Job:
    recipe: Recipe
    tiers: list[TierConfig]
    force: bool
    reason: str


class TierEngines:
    """The engine side of the agent's LLM tiers: resolve, open, build in the background."""

    def __init__(self, engines: EnginesConfig, models_dir: Path, on_event: Event, notifier: Notifier) -> None:
        self.config, self.models_dir = engines, models_dir
        self.cache = EngineCache(engines.cache_dir, engines.max_bytes)
        self.on_event, self.notifier = on_event, notifier
        self.ladder: TieredLLM | None = None  # the LLM tiers these engines serve (swapped onto new engines)
        self.starting = True  # the service start waits on what we do: EXTEND_TIMEOUT_USEC is allowed
        self.serving_status = ""  # the READY status line, restored when a build ends
        self.served: dict[str, Resolved] = {}  # tier name -> what it loaded last
        self._recipes: list[Recipe] | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()  # stopping: builds give up at their next step or sample

    # -- recipes ---------------------------------------------------------------------------------

    def all_recipes(self) -> list[Recipe]:
        if self._recipes is None:
            found = []
            for path in recipe_files(self.config.recipes_dir):  # the user's folder, then the shipped recipes
                try:
                    found.append(load_recipe(path))
                except ConfigError as exc:  # one broken recipe must not hide the others
                    log.warning("engine recipe %s ignored: %s", path, exc)
            self._recipes = found
        return self._recipes

    def recipe_for(self, tier: TierConfig) -> Recipe | None:
        return next((r for r in self.all_recipes() if r.workload == "llm" and same_model(r, tier.model)
                     and target_of(tier) in r.targets and tier.backend in TARGET_BACKENDS[target_of(tier)]), None)

    def recipes(self, tiers: list[TierConfig]) -> list[str]:
        return list(dict.fromkeys(r.name for t in tiers if (r := self.recipe_for(t)) is not None))

    # -- resolve and open --------------------------------------------------------------------------

    def resolve(self, tier: TierConfig) -> Resolved:
        from ..engines.fingerprint import device_fingerprint, runtime_version
        from ..engines.gate import Verdict, choose

        source = resolve_model(tier.model, self.models_dir)
        model_hash = hash_model(source.path, self.cache.root / "model-hashes.json")
        if tier.backend == "fake" or tier.precision == "bf16":
            return Resolved(tier.name, source, model_hash, why_plain=f"no engines for {tier.backend}/{tier.precision}")
        version, device = runtime_version(tier.backend), device_fingerprint(target_of(tier))
        precision = None if tier.precision == "auto" else tier.precision
        candidates = {e.key: e for e in self.cache.entries() if e.manifest.get("model_name") == source.name
                      and e.manifest.get("backend") == tier.backend and e.manifest.get("device") == device
                      and e.manifest.get("runtime_version") == version
                      and (e.manifest.get("key_parts") or {}).get("model") == model_hash
                      and (precision is None or e.manifest.get("precision") == precision)}
        while candidates:  # the gate's choice; a corrupt one is quarantined and the next best tried
            verdicts = {}
            for key, e in candidates.items():
                acc = e.manifest.get("accuracy") or {}
                verdicts[key] = Verdict(str(e.manifest.get("precision")), tier.backend, acc.get("metrics", {}), {},
                                        bool(acc.get("passed", True)), [], acc.get("latency_ms"),
                                        acc.get("reference_latency_ms"))
            best = choose(list(verdicts.values()))
            if best is None:
                break
            key = next(k for k, v in verdicts.items() if v is best)
            entry = self.cache.lookup(key)  # re-hashes every file; quarantines a mismatch
            if entry is not None:
                return Resolved(tier.name, source, model_hash, entry)
            del candidates[key]
            reason = self._quarantine_reason(key)
            self.on_event("engine_quarantined", {"workload": "llm", "tier": tier.name, "key": key,
                                                 "reason": reason})
        why = "no engine in the cache for this runtime, device and model" + (f" ({precision})" if precision else "")
        return Resolved(tier.name, source, model_hash, why_plain=why)

    def open(self, tier: TierConfig, device_threads: int = 0) -> DecoderLM:
        """Resolve and open ``tier`` (the tier's ``Tier.open``); records what it serves."""
        resolved = self.resolve(tier)
        if resolved.engine is None:
            options = SessionOptions(device=tier.device, threads=device_threads, precision=tier.precision,
                                     cache_dir=self.cache.root)
            lm = DecoderLM.open(resolved.source, tier.backend, options)
            log.info("tier %r serves its model folder %s (%s)", tier.name, resolved.source.path, resolved.why_plain)
        else:
            lm = _open_engine(resolved, tier, device_threads)
            m = resolved.engine.manifest
            log.info("tier %r serves engine %s (%s/%s%s)", tier.name, resolved.engine.key[:12], m.get("backend"),
                     m.get("precision"), f" {m['flavour']}" if m.get("flavour") else "")
        self.served[tier.name] = resolved
        return lm

    def identities(self) -> dict[str, str]:
        return {name: r.identity for name, r in self.served.items()}

    # -- builds ----------------------------------------------------------------------------------

    def start_builds(self, tiers: list[TierConfig]) -> list[dict[str, Any]]:
        """Queue one background build per recipe of the tiers that serve no engine (the worker skips a
        tier whose engine turns out to be cached)."""
        by_recipe: dict[str, tuple[Recipe, list[TierConfig]]] = {}
        for tier in tiers:
            recipe, served = self.recipe_for(tier), self.served.get(tier.name)
            if recipe is not None and not (served is not None and served.engine is not None):
                by_recipe.setdefault(recipe.name, (recipe, []))[1].append(tier)
        return [self.schedule(r, ts, False, "no engine cached at start") for r, ts in by_recipe.values()]

    def rebuild(self, name: str, tiers: list[TierConfig]) -> dict[str, Any]:
        """The ``rebuild_engine`` command: build ``name`` again (forced) for the tiers it serves."""
        self._recipes = None  # re-read: the field engineer may have edited the recipe since the start
        mine = [t for t in tiers if (r := self.recipe_for(t)) is not None and r.name == name]
        if not mine:
            raise EdgeAgentError(f"no engine recipe {name!r} is configured for the LLM tiers on this device; "
                                 f"configured: {', '.join(self.recipes(tiers)) or '(none)'}")
        recipe = self.recipe_for(mine[0])
        assert recipe is not None
        return self.schedule(recipe, mine, True, "rebuild_engine command")

    def schedule(self, recipe: Recipe, tiers: list[TierConfig], force: bool, reason: str) -> dict[str, Any]:
        """Queue a background build of ``recipe`` for ``tiers``; returns at once. Without the build
        tooling (a core install, no ``[build]`` extra) nothing is queued: one ``engine_build`` event
        and one log line say why, and the model folder keeps serving."""
        missing = [m for m in BUILD_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            why = (f"engine building is not installed ({', '.join(missing)} missing): "
                   "pip install 'edge-agent[build]'; the model folder serves meanwhile")
            log.warning("engine build %s skipped: %s", recipe.name, why)
            self.on_event("engine_build", {"workload": "llm", "recipe": recipe.name, "tiers": [t.name for t in tiers],
                                           "state": "failed", "reason": reason, "error": why})
            return {"recipe": recipe.name, "state": f"skipped: {why}", "tiers": [t.name for t in tiers]}
        with self._lock:
            if self._cancel.is_set():
                return {"recipe": recipe.name, "state": "refused: the agent is stopping",
                        "tiers": [t.name for t in tiers]}
            if recipe.name in self._pending:
                return {"recipe": recipe.name, "state": "already queued or running", "tiers": [t.name for t in tiers]}
            self._pending.add(recipe.name)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="engine-build", daemon=True)
                self._worker.start()
            position = self._jobs.qsize()
        self._jobs.put(_Job(recipe, tiers, force, reason))
        return {"recipe": recipe.name, "state": "started" if position == 0 else "queued",
                "tiers": [t.name for t in tiers]}

    def build_now(self, tier: TierConfig) -> bool:
        """Build ``tier``'s engine in the foreground (the start waits for it), keeping systemd patient."""
        recipe = self.recipe_for(tier)
        if recipe is None:
            return False
        return self._build(_Job(recipe, [tier], False, "no tier could load without an engine"),
                           Heartbeat(enabled=False, notifier=self.notifier, cancel=self._cancel))

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
                    self._build(job, _StatusHeartbeat(self.notifier, f"building engine {job.recipe.name}",
                                                      self._cancel))
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
            precisions = [p for p in recipe.precisions if p != "int4" or tier.backend == "openvino"] \
                if tier.precision == "auto" else [tier.precision]
            requests += [BuildRequest(target_of(tier), p, tier.backend, force=job.force) for p in precisions]
        base = {"workload": "llm", "recipe": recipe.name, "tiers": [t.name for t in job.tiers]}
        self.on_event("engine_build", {**base, "state": "started", "reason": job.reason,
                                       "precisions": [r.precision for r in requests]})
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
                log.info("engine build %s %s cancelled: the agent is stopping (finished steps stay staged)",
                         recipe.name, label)
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
            self.on_event("engine_build", {**base, "state": "cancelled", "build_s": seconds, "built": built,
                                           "reason": "the agent is stopping"})
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
            if tier.name in ready and not self._cancel.is_set():
                self._swap_in(tier.name)
        return bool(ready)

    def _swap_in(self, tier: str) -> None:
        """A build passed the gate: the tier serving now reloads onto its engine in place (loaded and
        warmed aside, swapped between batches, no request fails); another tier picks its engine up
        the next time it is loaded (a controller switch)."""
        ladder = self.ladder
        if ladder is None or ladder.active_tier != tier or not reload_in_place(ladder, ladder.active):
            return
        ladder.wait_switched()
        now = self.served.get(tier)
        ok = ladder.active_tier == tier and now is not None and now.engine is not None
        self.on_event("engine_swap", {"workload": "llm", "tier": tier, "ok": ok,
                                      "serving": now.identity if now is not None else None})

    def build_then_start(self, ladder: TieredLLM, tiers: list[TierConfig], errors: list[str]) -> None:
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
                    errors.append(f"{tier.name} (built engine): {exc}")
        raise ModelError("no LLM tier could be loaded: " + "; ".join(errors))

    def _engine_for(self, tier: TierConfig) -> Entry | None:
        try:
            return self.resolve(tier).engine
        except EdgeAgentError:
            return None

    def _status(self, text: str) -> None:
        if text:
            self.notifier.status(text[:200])

    def _quarantine_reason(self, key: str) -> str:
        found = sorted(self.cache.quarantine_dir.glob(f"{key}-*"))
        try:
            return (found[-1] / "QUARANTINED").read_text().strip() if found else "failed verification"
        except OSError:
            return "failed verification"


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


def _open_engine(resolved: Resolved, tier: TierConfig, threads: int) -> DecoderLM:
    """Open a cached engine folder like the build's gate did (same precision hint, same compiled blob)."""
    from ..engines.stages import ov_hint

    entry = resolved.engine
    assert entry is not None
    parts = entry.manifest["key_parts"]
    ref = resolved.ref
    if parts["backend"] == "openvino":
        hint = ov_hint(parts)
        options = SessionOptions(device=tier.device, precision=hint, threads=threads,  # type: ignore[arg-type]
                                 cache_dir=entry.artifact)
        return DecoderLM.open(ref, "openvino", options)
    if parts["backend"] == "tensorrt":  # a plan, not model.onnx: open the session and wrap it ourselves
        session = open_session(entry.path / entry.manifest["graph"], "tensorrt", SessionOptions(device=tier.device),
                               warmup=lambda _s: None)
        try:
            lm = DecoderLM(ref, session)
            lm.warmup()
        except BaseException:
            session.close()
            raise
        return lm
    # The graph already carries its precision (FP16 weights, INT8 Q/DQ): no second conversion.
    return DecoderLM.open(ref, parts["backend"], SessionOptions(device=tier.device, threads=threads))


def reload_in_place(served: TieredLLM, index: int, wait_s: float = 120.0) -> bool:
    """Reload the serving tier ``index`` (now resolving to its engine), waiting out a switch already
    in progress; False when ``index`` is not the active tier (it picks its engine up when next loaded)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if served.active_tier is None or served.active != index:
            return False
        if served.switch_to(index, reload=True):
            return True
        served.wait_switched(1.0)
    return False
