"""``edge-agent bench tiers``: a rising, holding and falling Poisson load on a tier ladder, adaptive vs. fixed.

The same seeded arrival schedule runs twice in one process: once through the tier controller
(``TieredLLM`` + ``TierController``, switching between demo tiers of clearly different cost), once on
the fixed top tier. The load is sized from a measured request on the top tier so that its peak
overloads the top tier but not the light one. Reported: a timeline (offered rate, active tier, TTFT
P95 per time bucket for both runs), every switch with its reason, failed requests (must be 0), shed
requests, and the time spent over the SLA target, adaptive vs. fixed.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..backends import SessionOptions
from ..errors import EdgeAgentError, InputError, Overloaded
from ..metrics.window import nearest_rank
from ..models.catalog import resolve_model
from ..models.llm import DecoderLM
from ..models.sampling import SamplingParams
from ..progress import Progress
from ..serving.llm.ladder import Tier, TieredLLM
from ..serving.llm.scheduler import Limits
from ..serving.tier_control import TierController
from ..serving.tier_policy import Policy

PROMPTS = ("Turn on the kitchen lights.", "What is the weather like tomorrow morning?",
           "Summarize my meeting notes in two sentences.", "Set a timer for twelve minutes.",
           "Translate 'good evening' into French.", "Which room is the warmest right now?")
PHASES = ((0.25, "rise"), (0.35, "hold"), (0.25, "fall"), (0.15, "tail"))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tiers", help="rising/holding/falling load: tier controller vs a fixed top tier",
                              description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("llm", "asr"), default="llm",
                   help="llm: the LLM ladder on chat requests (default); asr: the ASR ladder on real-time spoken-command "
                   "streams (bench/tiers_asr.py)")
    p.add_argument("--tiers", default=None, help="model ladder, heaviest first (comma separated; default "
                   "demo-phi3-small,demo-phi3 for llm, demo-whisper,demo-asr for asr)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=None, help="seconds per run (default 60 for llm, 35 for asr)")
    p.add_argument("--base-rate", type=float, default=None, help="requests/s at the start and end (default: the top "
                   "tier's single-request rate, 1 / its e2e alone; asr: 0.3 streams/s)")
    p.add_argument("--peak-rate", type=float, default=None, help="requests/s at the peak (default: 5 × that rate, "
                   "beyond what batching lets the top tier serve; asr: 1.5 streams/s)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--target-ms", type=float, default=None, help="P95 target: TTFT for llm (default 387, the agent's "
                   "SLA), first_partial_ms for asr (default [sla.asr] target_ms, 300)")
    p.add_argument("--window-s", type=float, default=6.0)
    p.add_argument("--evaluate-every-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", dest="json_out", metavar="OUT")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)
    return p


def rate_at(t: float, duration: float, base: float, peak: float) -> float:
    """Offered load at ``t``: linear rise, hold at the peak, linear fall, then the base rate."""
    rise, hold, fall = (f * duration for f, _ in PHASES[:3])
    if t < rise:
        return base + (peak - base) * t / rise
    if t < rise + hold:
        return peak
    if t < rise + hold + fall:
        return peak - (peak - base) * (t - rise - hold) / fall
    return base


def arrivals(duration: float, base: float, peak: float, seed: int) -> list[float]:
    """Non-homogeneous Poisson arrivals by thinning (Lewis & Shedler), seeded."""
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= duration:
            return out
        if rng.random() < rate_at(t, duration, base, peak) / peak:
            out.append(t)


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
        rows.append({"t_s": offset, "ttft_ms": done.timing.ttft_ms, "e2e_ms": done.timing.e2e_ms,
                     "tier": handle.tier or "?"})
    return {"requests": len(schedule), "completed": len(rows), "failed": failed, "shed": shed,
            "errors": errors[:5], "rows": rows, "wall_s": time.monotonic() - start}


def _p(values: Sequence[float], q: float) -> float | None:
    return nearest_rank(sorted(values), q)


def timeline(run: dict, duration: float, bucket_s: float, target: float,
             metric: str = "ttft_ms") -> tuple[list[dict], float]:
    """Per bucket: the metric's P95 over the arrivals in it (``<metric>_p95_ms``) and the tier that
    served most of them; and the seconds of buckets over target."""
    key = _p95_key(metric)
    buckets, over_s = [], 0.0
    for b in range(math.ceil(duration / bucket_s)):
        lo, hi = b * bucket_s, (b + 1) * bucket_s
        inside = [r for r in run["rows"] if lo <= r["t_s"] < hi]
        tiers = [r["tier"] for r in inside]
        p95 = _p([r[metric] for r in inside if r[metric] is not None], 95)
        if p95 is not None and p95 > target:
            over_s += bucket_s
        buckets.append({"t_s": lo, "count": len(inside), key: p95,
                        "tier": max(set(tiers), key=tiers.count) if tiers else None})
    return buckets, over_s


def _p95_key(metric: str) -> str:
    return f"{metric.removesuffix('_ms')}_p95_ms"


def table_lines(r: dict, metric: str, fixed_label: str, keys: Sequence[str]) -> list[str]:
    """The timeline, the switches and the adaptive-vs-fixed summary of a tier bench report."""
    key = _p95_key(metric)
    fmt = lambda v: "—" if v is None else f"{v:.0f}"  # noqa: E731
    lines = [f"{'t (s)':>6} {'rate/s':>7} {'tier':<16} {'adaptive P95':>13} {'fixed P95':>11}"]
    for row in r["timeline"]:
        lines.append(f"{row['t_s']:>6.1f} {row['rate']:>7.2f} {row['tier'] or '—':<16} "
                     f"{fmt(row[f'adaptive_{key}']):>13} {fmt(row[f'fixed_{key}']):>11}")
    lines += [f"switch at {s['t_s']:.1f} s: {s['from']} → {s['to']} ({s['reason']})" for s in r["switches"]]
    lines.append(f"{'':<24}{'adaptive':>12}{fixed_label:>12}")
    a, f = r["adaptive"], r["fixed"]
    for k in keys:
        fa, ff = a[k], f[k]
        lines.append(f"{k:<24}{'—' if fa is None else f'{fa:.1f}':>12}{'—' if ff is None else f'{ff:.1f}':>12}")
    ratio = r["over_target_ratio"]
    lines.append(f"switches: {len(r['switches'])}; time over target adaptive/fixed: "
                 f"{'—' if ratio is None else f'{ratio:.2f}'}; served by tier: {a['served_by_tier']}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.workload == "asr":
        from . import tiers_asr

        return tiers_asr.run(args)
    args.tiers = args.tiers or "demo-phi3-small,demo-phi3"
    args.duration_s = 60.0 if args.duration_s is None else args.duration_s
    args.target_ms = args.target_ms or 387.0
    names = [n.strip() for n in args.tiers.split(",") if n.strip()]
    if len(names) < 2:
        raise InputError("--tiers needs at least two models, heaviest first")
    if args.duration_s < 10:
        raise InputError(f"--duration-s must be at least 10, got {args.duration_s}")
    from ..config import load_settings

    cache = load_settings(None).models.cache_dir
    show = not args.quiet
    refs = [resolve_model(n, cache) for n in names]
    options = SessionOptions(device="cpu", threads=args.threads)
    limits = Limits(max_batch=args.max_batch, batch_timeout_ms=10.0, preferred_batch_sizes=(),
                    max_queue=10_000, queue_timeout_ms=600_000.0)
    ladder = [Tier(ref.name, (lambda r=ref: DecoderLM.open(r, "onnxruntime", options)), limits, args.max_new_tokens)
              for ref in refs]

    # Size the load from the top tier: one request alone, after a warm-up.
    probe = TieredLLM(ladder[:1]).start()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    probe.submit(PROMPTS[0], params).result(600)
    single_s = probe.submit(PROMPTS[1], params).result(600).timing.e2e_ms / 1e3
    probe.stop()
    base = args.base_rate or 1.0 / single_s
    peak = args.peak_rate or 5.0 / single_s
    if not 0 < base <= peak:
        raise InputError(f"need 0 < --base-rate ({base:g}) <= --peak-rate ({peak:g})")
    schedule = arrivals(args.duration_s, base, peak, args.seed)

    policy = Policy(metric="ttft_ms", percentile=95, target_ms=args.target_ms, min_samples=6, downgrade_after=2,
                    upgrade_after=3, upgrade_ratio=0.7, cooldown_s=4 * args.evaluate_every_s,
                    min_dwell_s=2 * args.evaluate_every_s, max_batch=args.max_batch)
    events: list[tuple[float, str, dict]] = []
    holder: dict = {}
    t0 = [time.monotonic()]
    served = TieredLLM(ladder, observe=lambda obs: holder["c"].observe(obs),
                       on_switched=lambda old, new, ms, err: (events.append((time.monotonic() - t0[0], "loaded",
                                                              {"to": ladder[new].name, "load_ms": ms, "error": err})),
                                                              err and holder["c"].switch_failed(old, new, err))).start()
    controller = holder["c"] = TierController(
        served, policy, window_s=args.window_s, evaluate_every_s=args.evaluate_every_s,
        on_event=lambda kind, payload: events.append((time.monotonic() - t0[0], kind, payload)))
    t0[0] = time.monotonic()
    controller.start()
    try:
        adaptive = _drive(served, schedule, args.max_new_tokens, "adaptive run", show)
    finally:
        controller.stop()
        served.stop()
    fixed_served = TieredLLM(ladder[:1]).start()
    try:
        fixed = _drive(fixed_served, schedule, args.max_new_tokens, "fixed top tier", show)
    finally:
        fixed_served.stop()

    bucket_s = max(1.0, args.duration_s / 30)
    tl_a, over_a = timeline(adaptive, args.duration_s, bucket_s, args.target_ms)
    tl_f, over_f = timeline(fixed, args.duration_s, bucket_s, args.target_ms)
    switches = [{"t_s": round(t, 2), **p} for t, kind, p in events if kind == "tier_switch"]
    report = {
        "tiers": names, "threads": args.threads, "duration_s": args.duration_s, "target_ms": args.target_ms,
        "single_request_s": single_s, "base_rate": base, "peak_rate": peak, "requests": len(schedule),
        "policy": {k: getattr(policy, k) for k in ("percentile", "min_samples", "downgrade_after", "upgrade_after",
                                                   "upgrade_ratio", "cooldown_s", "min_dwell_s")},
        "window_s": args.window_s, "evaluate_every_s": args.evaluate_every_s,
        "adaptive": _summary(adaptive, over_a), "fixed": _summary(fixed, over_f),
        "over_target_ratio": (over_a / over_f) if over_f else None,
        "switches": switches, "events": [{"t_s": round(t, 2), "kind": k, **p} for t, k, p in events],
        "timeline": [{"t_s": a["t_s"], "rate": rate_at(a["t_s"] + bucket_s / 2, args.duration_s, base, peak),
                      "tier": a["tier"], "adaptive_ttft_p95_ms": a["ttft_p95_ms"],
                      "fixed_ttft_p95_ms": f["ttft_p95_ms"]} for a, f in zip(tl_a, tl_f)],
        "raw": {"adaptive": adaptive["rows"], "fixed": fixed["rows"]},
    }
    print(format_report(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_tiers(report, Path(args.plot))
    return 1 if adaptive["failed"] else 0


def _summary(run: dict, over_s: float) -> dict:
    ttfts = [r["ttft_ms"] for r in run["rows"]]
    by_tier: dict[str, int] = {}
    for r in run["rows"]:
        by_tier[r["tier"]] = by_tier.get(r["tier"], 0) + 1
    return {"requests": run["requests"], "completed": run["completed"], "failed": run["failed"], "shed": run["shed"],
            "errors": run["errors"], "ttft_p50_ms": _p(ttfts, 50), "ttft_p95_ms": _p(ttfts, 95),
            "ttft_p99_ms": _p(ttfts, 99), "time_over_target_s": over_s, "served_by_tier": by_tier}


def format_report(r: dict) -> str:
    head = (f"tier bench: {' > '.join(r['tiers'])}, {r['duration_s']:g} s, Poisson {r['base_rate']:.2f} → "
            f"{r['peak_rate']:.2f} → {r['base_rate']:.2f} req/s ({r['requests']} requests), "
            f"target TTFT P95 ≤ {r['target_ms']:g} ms")
    keys = ("completed", "failed", "shed", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "time_over_target_s")
    return "\n".join([head, *table_lines(r, "ttft_ms", "fixed top", keys)])


def plot_tiers(r: dict, path: Path, metric: str = "ttft_ms", label: str = "TTFT", unit: str = "req/s",
               title: str = "Tier controller vs fixed top tier", count: str = "requests") -> Path:
    """Latency over time for both arms (switches marked, offered load), and the tier serving each arrival."""
    from .plot import _pyplot

    plt = _pyplot()
    fig, (ax, ax_tier) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    p95 = f"{metric.removesuffix('_ms')}_p95_ms"
    for side, color in (("fixed", "tab:orange"), ("adaptive", "tab:blue")):
        rows = [x for x in r["raw"][side] if x[metric] is not None]
        ax.scatter([x["t_s"] for x in rows], [x[metric] for x in rows], s=8, color=color, alpha=0.6,
                   label=f"{side} (P95 {r[side][p95] or 0:.0f} ms)")
    ax.axhline(r["target_ms"], color="red", linestyle="--", linewidth=1, label=f"target {r['target_ms']:g} ms")
    for s in r["switches"]:
        ax.axvline(s["t_s"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"→ {s['to']}", (s["t_s"], ax.get_ylim()[1] * 0.95 if ax.get_ylim()[1] else 1), fontsize=8,
                    rotation=90, va="top")
    ax.set_yscale("log")
    ax.set_ylabel(f"{label} (ms, log)")
    ax.legend(loc="upper left")
    rate = ax.twinx()
    rate.plot([x["t_s"] for x in r["timeline"]], [x["rate"] for x in r["timeline"]], color="green", alpha=0.5)
    rate.set_ylabel(f"offered load ({unit})", color="green")
    order = {name: i for i, name in enumerate(r["tiers"])}
    rows = r["raw"]["adaptive"]
    ax_tier.scatter([x["t_s"] for x in rows], [order.get(x["tier"], -1) for x in rows], s=6, color="tab:blue")
    ax_tier.set_yticks(range(len(r["tiers"])), r["tiers"])
    ax_tier.invert_yaxis()
    ax_tier.set_xlabel("arrival time (s)")
    ax_tier.set_ylabel("serving tier")
    fig.suptitle(f"{title} · {r[count]} {count} · switches {len(r['switches'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
