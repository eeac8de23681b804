"""``edge-agent bench tiers``: a rising, holding and falling Poisson load on a tier ladder, adaptive vs. fixed.

The same seeded arrival schedule runs twice in one process: once through the tier controller
(``TieredLLM`` + ``TierController``, switching between demo tiers of clearly different cost), once on
the fixed top tier. The load is sized from a measured request on the top tier so that its peak
overloads the top tier but not the light one. Reported: a timeline (offered rate, active tier, TTFT
P95 per time bucket for both runs), every switch with its reason, failed requests (must be 0), shed
requests, and the time spent over the SLA target, adaptive vs. fixed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..backends import SessionOptions
from ..errors import EdgeAgentError, InputError, Overloaded
from ..metrics.window import percentile
from ..models.catalog import ModelRef, resolve_model
from ..models.llm import DecoderLM
from ..models.sampling import SamplingParams
from ..progress import Progress
from ..serving.llm.scheduler import Limits
from ..serving.llm.tiers import Tier, TieredLLM
from ..serving.tiers.control import TierController
from ..serving.tiers.policy import Policy, knobs
from .options import TiersOptions
from .ramp import arrivals, plot_tiers, rate_at, table_lines, timeline

PROMPTS = (
    "Turn on the kitchen lights.",
    "What is the weather like tomorrow morning?",
    "Summarize my meeting notes in two sentences.",
    "Set a timer for twelve minutes.",
    "Translate 'good evening' into French.",
    "Which room is the warmest right now?",
)


def _drive(served: TieredLLM, schedule: Sequence[float], max_new: int, label: str, show: bool) -> dict:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    handles, shed = [], 0
    start = time.monotonic()
    with Progress(label, "req", enabled=show) as bar:
        for k, offset in enumerate(schedule):
            delay = start + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                handles.append((offset, served.submit(PROMPTS[k % len(PROMPTS)], params)))
            except Overloaded:
                shed += 1
            bar.update(k + 1, len(schedule))
    rows, failed, errors = [], 0, []
    for offset, handle in handles:
        try:
            done = handle.result(600)
        except EdgeAgentError as exc:
            failed += 1
            errors.append(str(exc))
            continue
        rows.append(
            {"t_s": offset, "ttft_ms": done.timing.ttft_ms, "e2e_ms": done.timing.e2e_ms, "tier": handle.tier or "?"}
        )
    return {
        "requests": len(schedule),
        "completed": len(rows),
        "failed": failed,
        "shed": shed,
        "errors": errors[:5],
        "rows": rows,
        "wall_s": time.monotonic() - start,
    }


def run(opts: TiersOptions) -> int:
    if opts.workload == "asr":
        from . import tiers_asr

        return tiers_asr.run(opts)
    plan = _llm_plan(opts)
    show = not opts.quiet
    ladder = _ladder(opts, plan.names)
    load = _size_load(ladder[0], opts, plan.duration_s)
    policy = _policy(opts, plan.target_ms)
    adaptive, events = _adaptive_run(opts, ladder, policy, load.schedule, show)
    fixed = _fixed_run(ladder[0], load.schedule, opts.max_new_tokens, show)
    report = _report(opts, plan, load, policy, adaptive, fixed, events)
    print(format_report(report))
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if opts.plot:
        plot_tiers(report, Path(opts.plot))
    return 1 if adaptive["failed"] else 0


@dataclass(frozen=True, slots=True)
class _Load:
    """The arrival schedule both runs replay, and what sized it: the top tier's e2e for one request
    alone, and the base and peak rates (requests/s)."""

    single_s: float
    base: float
    peak: float
    schedule: list[float]


@dataclass(frozen=True, slots=True)
class _Plan:
    """The llm workload's settings with their defaults filled in: the tier models (heaviest first), the
    seconds per run and the TTFT P95 target."""

    names: list[str]
    duration_s: float
    target_ms: float


def _llm_plan(opts: TiersOptions) -> _Plan:
    """The llm workload's defaults filled in and checked."""
    names = [n.strip() for n in (opts.tiers or "demo-phi3-small,demo-phi3").split(",") if n.strip()]
    if len(names) < 2:
        raise InputError("--tiers needs at least two models, heaviest first")
    duration_s = 60.0 if opts.duration_s is None else opts.duration_s
    if duration_s < 10:
        raise InputError(f"--duration-s must be at least 10, got {duration_s}")
    return _Plan(names, duration_s, opts.target_ms or 387.0)


def _ladder(opts: TiersOptions, names: list[str]) -> list[Tier]:
    """One tier per model, resolved from the configured model cache: a DecoderLM on ONNX Runtime's
    CPU with ``--threads``, ``--max-batch`` and ``--max-new-tokens``, and a queue that takes the
    whole schedule."""
    from ..config import load_settings

    cache = load_settings(None).models.cache_dir
    refs = [resolve_model(n, cache) for n in names]
    options = SessionOptions(device="cpu", threads=opts.threads)
    limits = Limits(
        max_batch=opts.max_batch,
        batch_timeout_ms=10.0,
        preferred_batch_sizes=(),
        max_queue=10_000,
        queue_timeout_ms=600_000.0,
    )

    def opener(ref: ModelRef) -> Callable[[], DecoderLM]:
        return lambda: DecoderLM.open(ref, "onnxruntime", options)

    return [Tier(ref.name, opener(ref), limits, opts.max_new_tokens) for ref in refs]


def _size_load(top: Tier, opts: TiersOptions, duration_s: float) -> _Load:
    """Size the load from the top tier: one request alone, after a warm-up, gives its e2e; the rates
    default to 1× (base) and 5× (peak) the rate that serves such requests back to back."""
    probe = TieredLLM([top])
    probe.start()
    params = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=0.0, ignore_eos=True)
    probe.submit(PROMPTS[0], params).result(600)
    single_s = probe.submit(PROMPTS[1], params).result(600).timing.e2e_ms / 1e3
    probe.stop()
    base = opts.base_rate or 1.0 / single_s
    peak = opts.peak_rate or 5.0 / single_s
    if not 0 < base <= peak:
        raise InputError(f"need 0 < --base-rate ({base:g}) <= --peak-rate ({peak:g})")
    return _Load(single_s, base, peak, arrivals(duration_s, base, peak, opts.seed))


def _policy(opts: TiersOptions, target_ms: float) -> Policy:
    """The adaptive run's SLA policy: TTFT P95 against ``--target-ms``, its cooldown and dwell a few
    ``--evaluate-every-s`` long."""
    return Policy(
        metric="ttft_ms",
        percentile=95,
        target_ms=target_ms,
        min_samples=6,
        downgrade_after=2,
        upgrade_after=3,
        upgrade_ratio=0.7,
        cooldown_s=4 * opts.evaluate_every_s,
        min_dwell_s=2 * opts.evaluate_every_s,
        max_batch=opts.max_batch,
    )


def _adaptive_run(
    opts: TiersOptions, ladder: list[Tier], policy: Policy, schedule: Sequence[float], show: bool
) -> tuple[dict, list[tuple[float, str, dict]]]:
    """The schedule on the whole ladder with a TierController switching tiers: the run, and the
    controller's events and tier loads as (seconds since the controller started, kind, payload)."""
    events: list[tuple[float, str, dict]] = []
    holder: dict = {}
    t0 = [time.monotonic()]

    def switched(old: int, new: int, ms: float, err: str | None) -> None:
        events.append((time.monotonic() - t0[0], "loaded", {"to": ladder[new].name, "load_ms": ms, "error": err}))
        if err:
            holder["c"].switch_failed(old, new, err)

    served = TieredLLM(ladder, observe=lambda obs: holder["c"].observe(obs), on_switched=switched)
    served.start()
    controller = holder["c"] = TierController(
        served,
        policy,
        window_s=opts.window_s,
        evaluate_every_s=opts.evaluate_every_s,
        on_event=lambda kind, payload: events.append((time.monotonic() - t0[0], kind, payload)),
    )
    t0[0] = time.monotonic()
    controller.start()
    try:
        adaptive = _drive(served, schedule, opts.max_new_tokens, "adaptive run", show)
    finally:
        controller.stop()
        served.stop()
    return adaptive, events


def _fixed_run(top: Tier, schedule: Sequence[float], max_new: int, show: bool) -> dict:
    """The same schedule on the top tier alone, with no controller: what the adaptive run is compared with."""
    fixed_served = TieredLLM([top])
    fixed_served.start()
    try:
        return _drive(fixed_served, schedule, max_new, "fixed top tier", show)
    finally:
        fixed_served.stop()


def _report(
    opts: TiersOptions,
    plan: _Plan,
    load: _Load,
    policy: Policy,
    adaptive: dict,
    fixed: dict,
    events: list[tuple[float, str, dict]],
) -> dict:
    """What ``--json`` writes: the load and the policy, each run's summary and time over the target,
    the switches and every controller event, the timeline of both runs, and each request's row."""
    bucket_s = max(1.0, plan.duration_s / 30)
    tl_a, over_a = timeline(adaptive, plan.duration_s, bucket_s, plan.target_ms)
    tl_f, over_f = timeline(fixed, plan.duration_s, bucket_s, plan.target_ms)
    return {
        "tiers": plan.names,
        "threads": opts.threads,
        "duration_s": plan.duration_s,
        "target_ms": plan.target_ms,
        "single_request_s": load.single_s,
        "base_rate": load.base,
        "peak_rate": load.peak,
        "requests": len(load.schedule),
        "policy": knobs(policy),
        "window_s": opts.window_s,
        "evaluate_every_s": opts.evaluate_every_s,
        "adaptive": _summary(adaptive, over_a),
        "fixed": _summary(fixed, over_f),
        "over_target_ratio": (over_a / over_f) if over_f else None,
        "switches": [{"t_s": round(t, 2), **p} for t, kind, p in events if kind == "tier_switch"],
        "events": [{"t_s": round(t, 2), "kind": k, **p} for t, k, p in events],
        "timeline": _side_by_side(tl_a, tl_f, bucket_s, plan.duration_s, load),
        "raw": {"adaptive": adaptive["rows"], "fixed": fixed["rows"]},
    }


def _side_by_side(tl_a: list[dict], tl_f: list[dict], bucket_s: float, duration_s: float, load: _Load) -> list[dict]:
    """One row per time bucket: the rate offered at its middle, the adaptive run's tier, and each run's TTFT P95."""
    return [
        {
            "t_s": a["t_s"],
            "rate": rate_at(a["t_s"] + bucket_s / 2, duration_s, load.base, load.peak),
            "tier": a["tier"],
            "adaptive_ttft_p95_ms": a["ttft_p95_ms"],
            "fixed_ttft_p95_ms": f["ttft_p95_ms"],
        }
        for a, f in zip(tl_a, tl_f)
    ]


def _summary(run: dict, over_s: float) -> dict:
    ttfts = [r["ttft_ms"] for r in run["rows"]]
    by_tier: dict[str, int] = {}
    for r in run["rows"]:
        by_tier[r["tier"]] = by_tier.get(r["tier"], 0) + 1
    return {
        "requests": run["requests"],
        "completed": run["completed"],
        "failed": run["failed"],
        "shed": run["shed"],
        "errors": run["errors"],
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "ttft_p99_ms": percentile(ttfts, 99),
        "time_over_target_s": over_s,
        "served_by_tier": by_tier,
    }


def format_report(r: dict) -> str:
    head = (
        f"tier bench: {' > '.join(r['tiers'])}, {r['duration_s']:g} s, Poisson {r['base_rate']:.2f} → "
        f"{r['peak_rate']:.2f} → {r['base_rate']:.2f} req/s ({r['requests']} requests), "
        f"target TTFT P95 ≤ {r['target_ms']:g} ms"
    )
    keys = ("completed", "failed", "shed", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "time_over_target_s")
    return "\n".join([head, *table_lines(r, "ttft_ms", "fixed top", keys)])
