"""Every engine a recipe lists, built and gated for this machine: what ``edge-agent build --recipe NAME``
runs, and what ``models fetch`` and the demo run for a fetched LLM or Whisper so its tiers serve the engine
the gate chose from their first start (the daemon's background build is the same pipeline, one tier at a time).

``plan`` turns "these precisions" into build requests, skipping (with the reason) what this backend
cannot build; ``build_recipe`` runs them in turn and returns the decision (``report.decide``): a refused
candidate is a row of the report, never an error. Engines already cached are hits, so a second call costs
only the cache's checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .cache import EngineCache
from .heartbeat import Heartbeat
from .pipeline import BuildRequest, GateRefused, Pipeline
from .recipes import find_recipe, load_recipe
from .report import decide
from .stages import weight_only_unsupported

if TYPE_CHECKING:
    from ..config import Settings


def this_target(configured: str) -> str:
    """The build target when none is given: the config's ``device.target`` unless it is ``auto``, else
    what this machine is (a Jetson has /etc/nv_tegra_release, an Intel NPU shows up as
    /dev/accel/accel0), else ``cpu``."""
    if configured != "auto":
        return configured
    if Path("/etc/nv_tegra_release").exists():
        return "jetson"
    if Path("/dev/accel/accel0").exists():
        return "intel-npu"
    return "cpu"


def plan(
    pipe: Pipeline,
    target: str,
    precision: str = "all",
    backend: str | None = None,
    int8_flavour: str | None = None,
    data: Path | None = None,
    method: str | None = None,
    force: bool = False,
) -> tuple[list[BuildRequest], list[dict[str, str]]]:
    """The build requests for ``precision`` (``all``: every precision the recipe lists) and the candidates
    skipped with why (only under ``all``: a precision asked for by name is attempted and refused there)."""
    precisions = list(pipe.recipe.precisions) if precision == "all" else [precision]
    requests, skipped = [], []
    for p in precisions:
        chosen_backend = backend or pipe.backend_for(BuildRequest(target, p))
        why = weight_only_unsupported(chosen_backend, p)
        if target == "intel-npu" and pipe.recipe.workload == "llm" and p == "int8" and not int8_flavour:
            why = "the NPU's LLM mode takes weight-only formats (int4, int8w, fp16), not static INT8"
        if why and precision == "all":
            skipped.append({"candidate": f"{chosen_backend}/{p}", "why": why})
            continue
        flavour = int8_flavour if p == "int8" else None
        requests.append(BuildRequest(target, p, backend, flavour, data, method, force))
    return requests, skipped


def build_recipe(name: str, settings: Settings, quiet: bool = False) -> dict[str, Any] | None:
    """Build every precision of recipe ``name`` for this machine (see the module doc): the decision, or None
    when ``name`` has no recipe, or a speech recipe of one graph (a demo recogniser's: ``edge-agent build``
    builds those): then the imported folder serves. LLM and Whisper recipes are built."""
    try:
        path = find_recipe(name, settings.engines.recipes_dir)
    except ConfigError:  # no such recipe: nothing to build
        return None
    recipe = load_recipe(path)  # a broken recipe is an error, said as such
    if recipe.workload != "llm" and not recipe.graphs:
        return None
    cache = EngineCache(settings.engines.cache_dir, settings.engines.max_bytes)
    threads = settings.device.threads or 1
    pipe = Pipeline(recipe, cache, settings.models.cache_dir, threads, Heartbeat(enabled=not quiet))
    target = this_target(settings.device.target)
    requests, skipped = plan(pipe, target)
    reports = []
    for req in requests:
        try:
            reports.append(pipe.build(req))
        except GateRefused as exc:
            reports.append(exc.report)
    summary = decide(reports, recipe.workload, target, skipped)
    summary.update(recipe=recipe.name, target=target, workload=recipe.workload)
    return summary
