"""Figures, the printed table and the plot of ``edge-agent bench serve`` (the load is sent by
``serve_client.py``, the daemon's side is read by ``serve_daemon.py``).

Client percentiles are nearest-rank over the level's successful requests (``itl_ms``: between content
chunks, which can each carry several tokens: the ``tokens`` line gives both counts); ``goodput`` is the
successful requests whose TTFT is within the SLA, per second of the level's wall time;
``tokens_per_s`` is the usage chunks' ``completion_tokens`` over that wall time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ..metrics.window import percentile
from .serve_client import RequestResult

METRICS = ("ttft_ms", "itl_ms", "e2e_ms")
QUANTILES = (50, 95, 99)


def _stats(values: Sequence[float]) -> dict:
    out: dict = {f"p{p}": percentile(values, p) for p in QUANTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["count"] = len(values)
    return out


def client_figures(results: Sequence[RequestResult], wall_s: float, sla_ms: float) -> dict:
    """What the clients saw over one level."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [gap for r in ok for gap in r.itl_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    tokens = sum(r.tokens_out or 0 for r in ok)
    tokens_in = [r.tokens_in for r in ok if r.tokens_in is not None]
    good = sum(1 for r in ok if r.ttft_ms is not None and r.ttft_ms <= sla_ms)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(Counter(r.status for r in results if not r.ok)),
        "error_examples": sorted({f"{r.status}: {r.error}" for r in results if not r.ok})[:3],
        "no_content": sum(1 for r in ok if r.ttft_ms is None),
        "wall_s": wall_s,
        "ttfb_ms": _stats([r.ttfb_ms for r in ok if r.ttfb_ms is not None]),
        "ttft_ms": _stats(ttft),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats(e2e),
        "content_chunks": len(itl) + len(ttft),
        "ttft_values_ms": sorted(ttft),
        "tokens_out": tokens,
        "prompt_tokens_mean": sum(tokens_in) / len(tokens_in) if tokens_in else None,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "sla_met": good,
        "goodput": good / wall_s if wall_s > 0 else None,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ratios(client: dict, daemon: dict) -> dict:
    """client / daemon per metric and percentile (and mean)."""
    return {
        m: {k: _ratio(client[m].get(k), daemon[m].get(k)) for k in (*(f"p{p}" for p in QUANTILES), "mean")}
        for m in METRICS
    }


def against_c1(levels: list[dict]) -> None:
    """Each closed-loop level above C=1 gets ``vs_c1``: its client TTFT p50, ITL p50 and tokens/s over the
    C=1 level's of the same run (the cost of sharing the engine), when a C=1 level was run."""
    base = next((lv for lv in levels if lv["mode"] == "closed" and lv["concurrency"] == 1), None)
    if base is None:
        return
    b = base["client"]
    for lv in levels:
        if lv is base or lv["mode"] != "closed":
            continue
        c = lv["client"]
        lv["vs_c1"] = {
            "ttft_p50": _ratio(c["ttft_ms"].get("p50"), b["ttft_ms"].get("p50")),
            "itl_p50": _ratio(c["itl_ms"].get("p50"), b["itl_ms"].get("p50")),
            "tokens_per_s": _ratio(c["tokens_per_s"], b["tokens_per_s"]),
        }


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _triple(stats: dict, digits: int = 1) -> str:
    return " / ".join(_num(stats.get(f"p{p}"), digits) for p in QUANTILES)


def _ramp(level: dict) -> str:
    ramp = level.get("ramp_s") or 0.0
    return f", clients started {ramp / level['concurrency'] * 1e3:.0f} ms apart" if ramp else ""


def format_level(level: dict) -> str:
    """One level's table: client, daemon and their ratio for TTFT, ITL and E2E."""
    c, d, r = level["client"], level["daemon"], level["client_over_daemon"]
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(c["errors"].items())) or "none"
    failures = ", ".join(f"{k}: {v}" for k, v in sorted(d["failures"].items())) or "none"
    lines = [
        f"{level['label']} ({level['mode']}{_ramp(level)}): {c['requests']} requests in {c['wall_s']:.1f} s, "
        f"{_num(c['tokens_per_s'])} tok/s, {_num(c['requests_per_s'], 2)} req/s, "
        f"goodput {_num(c['goodput'], 2)}/s ({c['sla_met']}/{c['ok']} within the SLA)",
        f"{'metric':<9} {'client p50 / p95 / p99':>26} {'daemon p50 / p95 / p99':>26} {'client/daemon':>22}",
    ]
    for m in METRICS:
        lines.append(f"{m:<9} {_triple(c[m]):>26} {_triple(d[m]):>26} {_triple(r[m], 2):>22}")
    means = ", ".join(
        f"{m.removesuffix('_ms')} {_num(c[m]['mean'])}/{_num(d[m]['mean'])} ({_num(r[m]['mean'], 2)})" for m in METRICS
    )
    lines.append(f"{'mean':<9} client/daemon ms (ratio), exact: {means}")
    lines.append(f"{'ttfb_ms':<9} {_triple(c['ttfb_ms']):>26} {'(response head)':>26}")
    lines.append(
        f"{'requests':<9} {str(c['ok']) + ' ok, errors ' + errors:>26} "
        f"{str(d['requests']) + ' done, failed ' + failures:>26}"
    )
    lines.append(
        f"{'tokens':<9} {str(c['tokens_out']) + ' in ' + str(c['content_chunks']) + ' content chunks':>26} "
        f"{str(d['tokens_out']) + ' generated':>26}"
    )
    vs = level.get("vs_c1")
    if vs:
        lines.append(
            f"{'vs C=1':<9} client TTFT p50 ×{_num(vs['ttft_p50'], 2)}, ITL p50 ×{_num(vs['itl_p50'], 2)}, "
            f"tok/s ×{_num(vs['tokens_per_s'], 2)} (same run)"
        )
    mq = level.get("mqtt")
    if mq:
        lines.append(
            f"{'mqtt':<9} ttft p50/p95/p99 {_triple(mq['ttft_ms'])} ms over {mq['windows']} windows, "
            f"{mq['requests']} requests (windows also cover time outside this level)"
        )
    return "\n".join(lines)


def plot_levels(report: dict, out: Path) -> None:
    """TTFT and ITL percentiles per level, client solid, daemon dashed."""
    from .plot import pyplot

    plt = pyplot()
    levels = report["levels"]
    labels = [lv["label"] for lv in levels]
    xs = list(range(len(levels)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
        for p, colour in zip(QUANTILES, ("tab:blue", "tab:orange", "tab:red")):
            for side, style in (("client", "-"), ("daemon", "--")):
                ys = [lv[side][metric].get(f"p{p}") for lv in levels]
                ys_plot = [float("nan") if y is None else y for y in ys]
                ax.plot(xs, ys_plot, style, marker="o", color=colour, label=f"{side} p{p}")
        ax.set_xticks(xs, labels)
        ax.set_ylabel(f"{metric.removesuffix('_ms')} (ms)")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(report["header"][:120], fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
