"""The load ramp both tier benchmarks share (``bench tiers``, LLM and ASR), and its report.

Seeded Poisson arrivals on a rise / hold / fall / tail rate, each arm's P95 per time bucket against
the target, the side-by-side table and the plot. Workload-neutral: the metric is a parameter
(``ttft_ms`` for the LLM arms, ``first_partial_ms`` for the ASR ones).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..metrics.window import percentile

PHASES = ((0.25, "rise"), (0.35, "hold"), (0.25, "fall"), (0.15, "tail"))


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
    t, out = 0.0, list[float]()
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= duration:
            return out
        if rng.random() < rate_at(t, duration, base, peak) / peak:
            out.append(t)


def timeline(
    run: dict, duration: float, bucket_s: float, target: float, metric: str = "ttft_ms"
) -> tuple[list[dict], float]:
    """Per bucket: the metric's P95 over the arrivals in it (``<metric>_p95_ms``) and the tier that
    served most of them; and the seconds of buckets over target."""
    key = _p95_key(metric)
    buckets, over_s = [], 0.0
    for b in range(math.ceil(duration / bucket_s)):
        lo, hi = b * bucket_s, (b + 1) * bucket_s
        inside = [r for r in run["rows"] if lo <= r["t_s"] < hi]
        tiers = [r["tier"] for r in inside]
        p95 = percentile([r[metric] for r in inside if r[metric] is not None], 95)
        if p95 is not None and p95 > target:
            over_s += bucket_s
        buckets.append(
            {"t_s": lo, "count": len(inside), key: p95, "tier": max(set(tiers), key=tiers.count) if tiers else None}
        )
    return buckets, over_s


def _p95_key(metric: str) -> str:
    return f"{metric.removesuffix('_ms')}_p95_ms"


def table_lines(r: dict, metric: str, fixed_label: str, keys: Sequence[str]) -> list[str]:
    """The timeline, the switches and the adaptive-vs-fixed summary of a tier bench report."""
    key = _p95_key(metric)
    fmt = lambda v: "—" if v is None else f"{v:.0f}"  # noqa: E731
    lines = [f"{'t (s)':>6} {'rate/s':>7} {'tier':<16} {'adaptive P95':>13} {'fixed P95':>11}"]
    for row in r["timeline"]:
        lines.append(
            f"{row['t_s']:>6.1f} {row['rate']:>7.2f} {row['tier'] or '—':<16} "
            f"{fmt(row[f'adaptive_{key}']):>13} {fmt(row[f'fixed_{key}']):>11}"
        )
    lines += [f"switch at {s['t_s']:.1f} s: {s['from']} → {s['to']} ({s['reason']})" for s in r["switches"]]
    lines.append(f"{'':<24}{'adaptive':>12}{fixed_label:>12}")
    a, f = r["adaptive"], r["fixed"]
    for k in keys:
        fa, ff = a[k], f[k]
        lines.append(f"{k:<24}{'—' if fa is None else f'{fa:.1f}':>12}{'—' if ff is None else f'{ff:.1f}':>12}")
    ratio = r["over_target_ratio"]
    lines.append(
        f"switches: {len(r['switches'])}; time over target adaptive/fixed: "
        f"{'—' if ratio is None else f'{ratio:.2f}'}; served by tier: {a['served_by_tier']}"
    )
    return lines


def plot_tiers(
    r: dict,
    path: Path,
    metric: str = "ttft_ms",
    label: str = "TTFT",
    unit: str = "req/s",
    title: str = "Tier controller vs fixed top tier",
    count: str = "requests",
) -> Path:
    """Latency over time for both arms (switches marked, offered load), and the tier serving each arrival."""
    from .plot import pyplot

    plt = pyplot()
    fig, (ax, ax_tier) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    p95 = f"{metric.removesuffix('_ms')}_p95_ms"
    for side, color in (("fixed", "tab:orange"), ("adaptive", "tab:blue")):
        rows = [x for x in r["raw"][side] if x[metric] is not None]
        ax.scatter(
            [x["t_s"] for x in rows],
            [x[metric] for x in rows],
            s=8,
            color=color,
            alpha=0.6,
            label=f"{side} (P95 {r[side][p95] or 0:.0f} ms)",
        )
    ax.axhline(r["target_ms"], color="red", linestyle="--", linewidth=1, label=f"target {r['target_ms']:g} ms")
    for s in r["switches"]:
        ax.axvline(s["t_s"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(
            f"→ {s['to']}",
            (s["t_s"], ax.get_ylim()[1] * 0.95 if ax.get_ylim()[1] else 1),
            fontsize=8,
            rotation=90,
            va="top",
        )
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
