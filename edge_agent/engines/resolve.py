"""Which engine a serving tier loads: a verified cached engine, else its model folder; and opening it.

For a tier (model, backend, device, precision) ``EngineResolver.resolve`` picks the engine the
accuracy gate would choose among the *current* cache entries of that model: same runtime version
and device fingerprint, and built from the same model bytes (the entry's ``key_parts.model`` equals
the folder's hash, so an edited export never serves an engine of the old one). When some of them were
built from a recipe the agent knows as it is now (``engines.recipes_dir``, then the shipped recipes: the
entry's ``key_parts.recipe`` equals the recipe's fingerprint, and a weight-only engine's ``key_parts.weight_only``
the settings the recipe now gives its precision), only those compete: engines of an older
version of the recipe, or of a copy built by hand, stay in the cache but serve only when none is. (The
gate's speeds come from separate builds on a machine whose load varies, so an older engine measured on
idler cores would otherwise outrank the recipe's own choice.) Every candidate is
re-hashed before use; a corrupt one is quarantined, reported (``engine_quarantined``) and the next
one, or the plain model folder, is served: a bad cache never stops a start.

``open_resolved`` opens what was resolved the way the build's gate opened it (same precision hint,
same compiled blob).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import SessionOptions, npu, open_session
from ..errors import ConfigError
from ..models.catalog import DEMO_MODELS, ModelRef, inspect_folder, resolve_model
from ..models.llm import DecoderLM
from .cache import EngineCache, Entry, hash_model
from .recipes import Recipe
from .stages import ov_hint

if TYPE_CHECKING:
    from ..config import TierConfig
    from ..models.recognizer import Recognizer

log = logging.getLogger(__name__)

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
    """True when ``recipe`` builds the model a tier names (a demo name, or the same folder)."""
    if model in DEMO_MODELS or recipe.model in DEMO_MODELS:
        return model == recipe.model
    return recipe.resolve(recipe.model).resolve() == Path(model).expanduser().resolve()


class EngineResolver:
    """Resolves LLM and ASR tiers against one engine cache; ``on_event`` hears of quarantined entries."""

    def __init__(
        self, cache: EngineCache, models_dir: Path, on_event: Event, recipes_dir: Path | str | None = None
    ) -> None:
        """``recipes_dir``: the user's recipe folder (``engines.recipes_dir``); the shipped recipes always count."""
        self.cache, self.models_dir, self.on_event = cache, models_dir, on_event
        self.recipes_dir = recipes_dir
        self._recipes: list[Recipe] | None = None

    def recipes(self) -> list[Recipe]:
        """The recipes the agent knows as they are now: the user's folder's, then the shipped ones (a user's
        ``NAME.toml`` hides the shipped one). Read once; ``reread_recipes`` forgets them."""
        if self._recipes is None:
            from ..errors import ConfigError
            from .recipes import load_recipe, recipe_files

            found = []
            for path in recipe_files(self.recipes_dir):
                try:
                    found.append(load_recipe(path))
                except ConfigError as exc:  # one broken recipe must not hide the others
                    log.warning("engine recipe %s ignored: %s", path, exc)
            self._recipes = found
        return self._recipes

    def reread_recipes(self) -> None:
        """Read the recipes again at the next use (a field engineer may have edited one)."""
        self._recipes = None

    def resolve(self, tier: TierConfig, rung: str | None = None) -> Resolved:
        """The engine ``tier`` serves: with precision "auto", the gate's choice for ``rung`` (default: the
        tier's ``rung`` setting when it has one, else the top rung, the recipe's ``[accuracy]``): the
        fastest engine within that rung's budget (``[rungs.NAME]``). A lower rung no engine was judged
        within serves the top rung's choice."""
        from .recipes import TOP_RUNG

        rung = rung or getattr(tier, "rung", None) or TOP_RUNG

        source = resolve_model(tier.model, self.models_dir)
        model_hash = hash_model(source.path, self.cache.root / "model-hashes.json")
        if tier.backend == "fake" or tier.precision == "bf16":
            return Resolved(tier.name, source, model_hash, why_plain=f"no engines for {tier.backend}/{tier.precision}")
        candidates = self._candidates(tier, source, model_hash)
        precision = None if tier.precision == "auto" else tier.precision
        while candidates:  # the gate's choice; a corrupt one is quarantined and the next best tried
            key = self._choice(tier, candidates, rung)
            if key is None:
                break
            entry = self.cache.lookup(key)  # re-hashes every file; quarantines a mismatch
            if entry is not None:
                return Resolved(tier.name, source, model_hash, entry)
            del candidates[key]
            reason = self._quarantine_reason(key)
            self.on_event("engine_quarantined", {"workload": "llm", "tier": tier.name, "key": key, "reason": reason})
        why = "no engine in the cache for this runtime, device and model" + (f" ({precision})" if precision else "")
        return Resolved(tier.name, source, model_hash, why_plain=why)

    def weights(self, tier: TierConfig) -> str:
        """What ``resolve`` would serve ``tier`` now, without verifying it (no re-hash): ``engine:KEY`` or
        ``model:HASH``. Tiers with equal weights can share one loaded model (the ladder's ``Tier.weights``)."""
        from .recipes import TOP_RUNG

        source = resolve_model(tier.model, self.models_dir)
        model_hash = hash_model(source.path, self.cache.root / "model-hashes.json")
        if tier.backend == "fake" or tier.precision == "bf16":
            return f"model:{model_hash}|{tier.backend}|{tier.device}|{tier.precision}"
        rung = getattr(tier, "rung", None) or TOP_RUNG
        key = self._choice(tier, self._candidates(tier, source, model_hash), rung, quiet=True)
        return f"engine:{key}" if key else f"model:{model_hash}|{tier.backend}|{tier.device}|{tier.precision}"

    def _candidates(self, tier: TierConfig, source: ModelRef, model_hash: str) -> dict[str, Entry]:
        """The cache entries ``tier`` may serve: this model's, for its runtime, device and precision."""
        from .fingerprint import device_fingerprint, runtime_version

        version, device = runtime_version(tier.backend), device_fingerprint(target_of(tier))
        precision = None if tier.precision == "auto" else tier.precision
        candidates = {
            e.key: e
            for e in self.cache.entries()
            if e.manifest.get("model_name") == source.name
            and e.manifest.get("backend") == tier.backend
            and e.manifest.get("device") == device
            and e.manifest.get("runtime_version") == version
            and (e.manifest.get("key_parts") or {}).get("model") == model_hash
            and (precision is None or e.manifest.get("precision") == precision)
        }
        # Engines of the recipes as they are now, when there are any, before those of older or other recipes.
        known = [(r.fingerprint(), r) for r in self.recipes()]
        current = {k: e for k, e in candidates.items() if _of_current_recipe(e, known)}
        candidates = current or candidates
        # An in-place KV engine (the same weights, no per-token cache copy) replaces a plain one of its precision.
        inplace = {e.manifest.get("precision") for e in candidates.values() if _layout(e)}
        return {k: e for k, e in candidates.items() if _layout(e) or e.manifest.get("precision") not in inplace}

    def _choice(self, tier: TierConfig, candidates: dict[str, Entry], rung: str, quiet: bool = False) -> str | None:
        """The key of the gate's choice among ``candidates`` for ``rung`` (a rung no engine is within: the
        top rung's), or None."""
        from .gate import Verdict, choose
        from .recipes import TOP_RUNG

        verdicts = {}
        for key, e in candidates.items():
            acc = e.manifest.get("accuracy") or {}
            verdicts[key] = Verdict(
                str(e.manifest.get("precision")),
                tier.backend,
                acc.get("metrics", {}),
                {},
                bool(acc.get("passed", True)),
                [],
                acc.get("latency_ms"),
                acc.get("reference_latency_ms"),
                rungs=dict(acc.get("rungs") or {}),
                weight_bytes=acc.get("weight_bytes"),
            )
        best = choose(list(verdicts.values()), rung)
        if best is None and rung != TOP_RUNG:
            if not quiet:
                log.info("tier %r: no engine within rung %r's budget; the top rung's choice serves", tier.name, rung)
            best = choose(list(verdicts.values()), TOP_RUNG)
        return None if best is None else next(k for k, v in verdicts.items() if v is best)

    def open(self, resolved: Resolved, tier: TierConfig, device_threads: int = 0) -> DecoderLM:
        """Open what ``resolve`` chose for ``tier``: the cached engine, else the model folder."""
        if resolved.engine is None:
            options = SessionOptions(
                device=tier.device,
                threads=device_threads,
                precision=tier.precision,
                cache_dir=self.cache.root,
                extra=npu_llm_options(resolved.source, tier),
            )
            lm = DecoderLM.open(resolved.source, tier.backend, options)
            log.info("tier %r serves its model folder %s (%s)", tier.name, resolved.source.path, resolved.why_plain)
            return lm
        lm = open_resolved(resolved, tier, device_threads)
        m = resolved.engine.manifest
        log.info(
            "tier %r serves engine %s (%s/%s%s)",
            tier.name,
            resolved.engine.key[:12],
            m.get("backend"),
            m.get("precision"),
            f" {m['flavour']}" if m.get("flavour") else "",
        )
        return lm

    def open_recognizer(
        self, resolved: Resolved, tier: TierConfig, device_threads: int = 0, **kwargs: Any
    ) -> Recognizer:
        """Open what ``resolve`` chose for an ASR ``tier``: the cached engine (a Whisper engine the recipe's gate
        chose), else the model folder; ``kwargs`` go to the recogniser (e.g. ``final_padding_s``)."""
        from ..models.asr import open_recognizer

        cache_dir = resolved.engine.artifact if resolved.engine else self.cache.root
        options = SessionOptions(
            device=tier.device, threads=device_threads, precision=tier.precision, cache_dir=cache_dir
        )
        recognizer = open_recognizer(resolved.ref, tier.backend, options, **kwargs)
        if resolved.engine is None:
            log.info("tier %r serves its model folder %s (%s)", tier.name, resolved.source.path, resolved.why_plain)
        else:
            precision = resolved.engine.manifest.get("precision")
            log.info("tier %r serves engine %s (%s)", tier.name, resolved.engine.key[:12], precision)
        return recognizer

    def _quarantine_reason(self, key: str) -> str:
        found = sorted(self.cache.quarantine_dir.glob(f"{key}-*"))
        try:
            return (found[-1] / "QUARANTINED").read_text().strip() if found else "failed verification"
        except OSError:
            return "failed verification"


def npu_llm_options(source: ModelRef, tier: TierConfig) -> dict[str, object]:
    """For an LLM tier on the NPU: the plugin's LLM mode as the model's recipe gives it (``[npu_llm]``;
    the defaults without one) and the model's sliding window; nothing for other devices."""
    from .recipes import load_recipe, recipe_files

    if tier.backend != "openvino" or not npu.is_npu(tier.device):
        return {}
    shape = npu.LlmShape()
    for path in recipe_files():
        try:
            recipe = load_recipe(path)
        except Exception:  # a broken recipe of another model must not stop this tier
            continue
        if recipe.workload == "llm" and same_model(recipe, tier.model):
            shape = recipe.npu_llm.shape() if recipe.npu_llm else shape
            break
    return {"npu_llm": shape, "sliding_window": source.config.get("sliding_window")}


def _of_current_recipe(entry: Entry, known: list[tuple[dict, Recipe]]) -> bool:
    """Whether ``entry`` is an engine one of the ``known`` recipes (fingerprint, recipe) builds as it is now:
    its key has the recipe's parts for its precision (``Recipe.precision_key``: the fingerprint, and the
    settings a weight-only precision gets, where a per-precision value is)."""
    parts = entry.manifest.get("key_parts") or {}
    for fingerprint, recipe in known:
        if parts.get("recipe") != fingerprint:  # the cheap test first
            continue
        try:
            wanted = recipe.precision_key(str(entry.manifest.get("precision")))
        except ConfigError:  # its calibration text is unreadable now: it cannot say
            continue
        if all(parts.get(k) == v for k, v in wanted.items()):
            return True
    return False


def _layout(entry: Entry) -> str:
    return str((entry.manifest.get("key_parts") or {}).get("layout") or "")


def open_resolved(resolved: Resolved, tier: TierConfig, threads: int) -> DecoderLM:
    """Open a cached engine folder like the build's gate did (same precision hint, same compiled blob)."""
    entry = resolved.engine
    assert entry is not None
    parts = entry.manifest["key_parts"]
    ref = resolved.ref
    if parts["backend"] == "openvino":
        hint = ov_hint(parts)
        spec = parts.get("npu_llm")
        # an NPU LLM engine compiles in the plugin's LLM mode with the shape it was built (and cached) for
        extra = {"npu_llm": npu.LlmShape(**spec)} if spec and npu.is_npu(tier.device) else {}
        options = SessionOptions(
            device=tier.device, precision=hint, threads=threads, cache_dir=entry.artifact, extra=extra
        )
        return DecoderLM.open(ref, "openvino", options)
    if parts["backend"] == "tensorrt":  # a plan, not model.onnx: open the session and wrap it ourselves
        session = open_session(
            entry.path / entry.manifest["graph"], "tensorrt", SessionOptions(device=tier.device), warmup=lambda _s: None
        )
        try:
            lm = DecoderLM(ref, session)
            lm.warmup()
        except BaseException:
            session.close()
            raise
        return lm
    # The graph already carries its precision (FP16 weights, INT8 Q/DQ): no second conversion.
    return DecoderLM.open(ref, parts["backend"], SessionOptions(device=tier.device, threads=threads))
