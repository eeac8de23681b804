"""The report of ``edge-agent bench voice``: per-side figures from the runs' rows, the ratios default /
baseline, the printed table and the plot of the turn-time distributions.

Report keys: ``turn_first_token_ms``, ``turn_complete_ms`` and ``endpoint_ms`` as ``{p50, p95}`` (taken
per round over the utterances, the median of the rounds reported; ``spread`` holds each one's
``[min, max]`` over the rounds), ``false_cuts`` as ``{count, rate,
of}`` (runs of utterances with a pause, all rounds), ``duplicated_calls`` and ``hit_tokens`` (totals, all
rounds), ``calls_right`` as ``{count, of, rate}`` (runs whose one delivered turn made exactly the expected
call, name and arguments, or no call where none is due) with the ``wrong`` runs listed; the default
side's at the top level, the baseline's under ``baseline``, and ``ratios``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

TIMES = ("turn_first_token_ms", "turn_complete_ms", "endpoint_ms")
SIDES = ("default", "baseline")


def _pct(values: list[float]) -> dict[str, float | None]:
    from ..metrics.window import MetricSnapshot

    snap = MetricSnapshot.of(values)
    return {"p50": snap.p50, "p95": snap.p95}


def side_figures(rows: list[dict]) -> dict:
    """One side's figures from its rows (every round)."""
    rounds = sorted({r["round"] for r in rows})
    out: dict = {"spread": {}}
    for metric in TIMES:
        per_round = [_pct([r[metric] for r in rows if r["round"] == k and r[metric] is not None]) for k in rounds]
        out[metric] = {stat: _median([p[stat] for p in per_round]) for stat in ("p50", "p95")}
        out["spread"][metric] = {stat: _range([p[stat] for p in per_round]) for stat in ("p50", "p95")}
    paused = [r for r in rows if r["pause"]]
    cuts = sum(r["cut"] for r in paused)
    out["false_cuts"] = {"count": cuts, "rate": cuts / len(paused) if paused else None, "of": len(paused)}
    out["duplicated_calls"] = sum(r["duplicated_calls"] for r in rows)
    out["hit_tokens"] = sum(r["hit_tokens"] for r in rows)
    # context beside the asked-for keys
    out["cuts_without_pause"] = sum(r["cut"] for r in rows if not r["pause"])
    out["prompt_tokens"] = sum(r["prompt_tokens"] for r in rows)
    out["runs"] = len(rows)
    out["runs_with_call"] = sum(bool(r["calls"]) for r in rows)
    right = sum(bool(r.get("right")) for r in rows)
    out["calls_right"] = {"count": right, "of": len(rows), "rate": right / len(rows) if rows else None}
    out["wrong"] = [
        {k: r.get(k) for k in ("round", "said", "voice", "heard", "calls", "expected")}
        for r in rows
        if not r.get("right")
    ]
    out["failed_turns"] = sum(len(r["errors"]) for r in rows)
    out["early_ends"] = sum(r["early_end"] for r in rows)
    out["cancelled_replies"] = sum(r["cancelled"] for r in rows)
    out["repeats_withheld"] = sum(r.get("repeats_withheld", 0) for r in rows)
    out["prefills_ahead"] = sum(r["prefill_ahead"] for r in rows)
    out["prefills_wasted"] = sum(r["prefill_wasted"] for r in rows)
    out["replies_ahead_used"] = sum(r.get("reply_ahead", 0) for r in rows)
    return out


def _range(values: list[float | None]) -> list[float] | None:
    present = [v for v in values if v is not None]
    return [round(min(present), 1), round(max(present), 1)] if present else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 1) if present else None


def ratios(default: dict, baseline: dict) -> dict:
    """default / baseline of each time percentile (None where the baseline's is missing or not positive)."""
    out: dict = {}
    for metric in TIMES:
        out[metric] = {}
        for stat in ("p50", "p95"):
            a, b = default[metric][stat], baseline[metric][stat]
            out[metric][stat] = round(a / b, 3) if a is not None and b is not None and a > 0 and b > 0 else None
    return out


def build_report(rows: list[dict], meta: dict) -> dict:
    default = side_figures([r for r in rows if r["side"] == "default"])
    baseline = side_figures([r for r in rows if r["side"] == "baseline"])
    return {
        **meta,
        **default,
        "baseline": baseline,
        "ratios": ratios(default, baseline),
        "rows": rows,
        "notes": [
            "times from the end of speech: when the audio block holding the last voiced sample was fed",
            "p50/p95 per round over the utterances, median of the rounds; counts are totals over all rounds",
            "baseline: "
            + ", ".join(f"{k} off" for k in meta.get("toggles", {}))
            + (f"; not in this configuration: {', '.join(meta['missing'])}" if meta.get("missing") else ""),
        ],
    }


def _fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def format_table(report: dict) -> str:
    base = report["baseline"]
    lines = [
        f"bench voice: {report['asr_model']} → {report['llm_model']} ({report['llm_backend']}) · "
        f"{report['utterances']} utterances ({report['with_pause']} with a {report['pause_ms']:.0f} ms pause) · "
        f"{report['rounds']} round(s), medians",
        f"voices (in turn): {', '.join(report.get('voices') or ['not recorded'])}",
        f"{'metric':<26}{'default':>12}{'baseline':>12}{'default/baseline':>18}   rounds' range: default · baseline",
    ]

    def span(side: dict, metric: str, stat: str) -> str:
        r = side["spread"][metric][stat]
        return "—" if r is None else f"{r[0]:.1f}–{r[1]:.1f}"

    for metric in TIMES:
        for stat in ("p50", "p95"):
            ratio = report["ratios"][metric][stat]
            lines.append(
                f"{metric + ' ' + stat:<26}{_fmt(report[metric][stat]):>12}{_fmt(base[metric][stat]):>12}"
                f"{(f'{ratio:.3f}' if ratio is not None else '—'):>18}   "
                f"{span(report, metric, stat)} · {span(base, metric, stat)}"
            )

    def cuts(side: dict) -> str:
        c = side["false_cuts"]
        return f"{c['count']}/{c['of']}"

    lines.append(f"{'false_cuts':<26}{cuts(report):>12}{cuts(base):>12}")

    def right(side: dict) -> str:
        c = side["calls_right"]
        return f"{c['count']}/{c['of']}"

    lines.append(f"{'calls right (name+args)':<26}{right(report):>12}{right(base):>12}")
    for key in (
        "duplicated_calls",
        "hit_tokens",
        "prompt_tokens",
        "early_ends",
        "cancelled_replies",
        "repeats_withheld",
        "prefills_ahead",
        "replies_ahead_used",
        "prefills_wasted",
        "runs_with_call",
    ):
        lines.append(f"{key:<26}{_fmt(report[key]):>12}{_fmt(base[key]):>12}")
    for w in report["wrong"][:12]:
        lines.append(f"wrong (default, round {w['round']}): said {w['said']!r}, heard {w['heard']} → {w['calls']}")
    if report.get("missing"):
        lines.append(f"not in this configuration (the baseline cannot turn them off): {', '.join(report['missing'])}")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> Path:
    """CDFs of the three turn times, default against baseline (every run of every round)."""
    from .plot import cdf, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    titles = {
        "endpoint_ms": "end of speech → end of turn",
        "turn_first_token_ms": "end of speech → first token",
        "turn_complete_ms": "end of speech → complete tool call",
    }
    for ax, metric in zip(axes, ("endpoint_ms", "turn_first_token_ms", "turn_complete_ms")):
        for side in SIDES:
            cdf(ax, [r[metric] for r in report["rows"] if r["side"] == side and r[metric] is not None], side)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of runs")
        ax.set_title(titles[metric])
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(
        f"bench voice: {report['asr_model']} → {report['llm_model']}, {report['utterances']} utterances × "
        f"{report['rounds']} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
