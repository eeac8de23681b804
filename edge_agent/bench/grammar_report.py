"""The report of ``bench grammar``: the cost of applying a mask to logits, the table (markdown, each engine's
figures with its ratio to llguidance beside them) and the optional plot."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EdgeAgentError
from .grammar_walk import apply_mask

REFERENCE = "llguidance"


def apply_cost(bitmask: np.ndarray, n_logits: int, rounds: int = 3, reps: int = 100) -> dict[str, Any]:
    """µs (median over rounds of each round's p50) to apply ``bitmask`` to float32 logits ``[rows, n_logits]``
    with ``grammar_walk.apply_mask`` and, when installed, llguidance's numpy reference; both must agree."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((bitmask.shape[0], n_logits), dtype=np.float32)
    ways: dict[str, Any] = {"numpy unpackbits + copyto (apply_mask)": apply_mask}
    try:
        from llguidance.numpy import apply_token_bitmask_inplace

        ways["llguidance.numpy.apply_token_bitmask_inplace"] = apply_token_bitmask_inplace
    except ImportError:
        pass
    outputs = []
    for fn in ways.values():
        out = base.copy()
        fn(out, bitmask)
        outputs.append(out)
    if any(not np.array_equal(outputs[0], o) for o in outputs[1:]):
        raise EdgeAgentError("apply_mask disagrees with llguidance's apply_token_bitmask_inplace")
    result: dict[str, Any] = {"shape": [bitmask.shape[0], n_logits], "us_p50": {}}
    for name, fn in ways.items():
        per_round = []
        for _ in range(rounds):
            logits = base.copy()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(logits, bitmask)
                times.append((time.perf_counter() - t0) * 1e6)
            per_round.append(statistics.median(times))
        result["us_p50"][name] = statistics.median(per_round)
    return result


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _cell(results: dict, engine: str, grammar: str, key: str) -> str:
    value = results[engine][grammar][key]
    ref = results.get(REFERENCE, {}).get(grammar, {}).get(key)
    if engine == REFERENCE or not ref or value is None:
        return _fmt(value)
    return f"{_fmt(value)} (×{value / ref:.2f})"


COLUMNS = (
    ("compile_ms", "compile ms"),
    ("first_mask_ms", "1st mask ms"),
    ("mask_us_b1_p50", "mask µs b1 p50"),
    ("mask_us_b1_p95", "b1 p95"),
    ("mask_us_bN_p50", "mask µs b{N} p50"),
    ("mask_us_bN_p95", "b{N} p95"),
    ("consume_us_b1_p50", "consume µs b1"),
)


def format_table(report: dict[str, Any]) -> str:
    """The report as markdown tables: engines, then per grammar and engine the medians with (×ratio to
    llguidance), then the mask-application cost and llguidance's whole per-step overhead."""
    n = report["batch"]
    lines = [
        f"tokenizer: {report['tokenizer']}",
        f"{report['rounds']} rounds (medians), ≥{report['tokens']} tokens per row per walk, batch 1 and {n}, "
        f"{report['threads']} threads, {report['cpu_count']} CPUs",
        "",
        "| engine | version | import ms | RSS +MB (import + vocabulary) | vocabulary ms | batch of rows |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in report["engines"].items():
        lines.append(
            f"| {name} | {e['version']} | {_fmt(e['import_ms'])} | {_fmt(e['rss_mb'])} | {_fmt(e['vocab_ms'])} "
            f"| {'; '.join(e['notes'])} |"
        )
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | |")
    heads = [h.replace("{N}", str(n)) for _, h in COLUMNS]
    lines += ["", "| grammar | engine | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    results = report["results"]
    grammars = list(next(iter(results.values())))
    for g in grammars:
        for engine in results:
            cells = [_cell(results, engine, g, key) for key, _ in COLUMNS]
            lines.append(f"| {g} | {engine} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"mask µs b{n}: one step of all {n} rows; ×r = engine / {REFERENCE} (same run, same documents)")
    apply = report["apply"]
    rows, cols = apply["shape"]
    lines += ["", f"| apply a mask to float32 logits [{rows}, {cols}] | µs p50 |", "|---|---|"]
    for name, us in apply["us_p50"].items():
        lines.append(f"| {name} | {_fmt(us)} |")
    fast = min(apply["us_p50"].values())
    if REFERENCE in results:
        for g in grammars:
            r = results[REFERENCE][g]
            total = (r["mask_us_bN_p50"] or 0) + (r["consume_us_bN_p50"] or 0) + fast
            lines.append(
                f"\n{REFERENCE} per decode step at batch {n}, {g}: mask {_fmt(r['mask_us_bN_p50'])} + consume "
                f"{_fmt(r['consume_us_bN_p50'])} + apply {_fmt(fast)} = {_fmt(total)} µs"
            )
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Bars: compile ms (log scale) and mask µs p50 at batch 1 and N, per grammar and engine."""
    from .plot import pyplot

    plt = pyplot()
    results = report["results"]
    engines = list(results)
    grammars = list(next(iter(results.values())))
    n = report["batch"]
    panels = (
        ("compile_ms", "compile (ms, log scale)", True),
        ("mask_us_b1_p50", "mask per step, batch 1 (µs p50)", False),
        ("mask_us_bN_p50", f"mask per step, batch {n} (µs p50)", False),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    width = 0.8 / len(engines)
    for ax, (key, title, log) in zip(axes, panels):
        for i, engine in enumerate(engines):
            xs = [j + i * width for j in range(len(grammars))]
            ys = [results[engine][g][key] or 0 for g in grammars]
            bars = ax.bar(xs, ys, width, label=engine)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(grammars))], grammars)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.15)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(engines), frameon=False)
    fig.suptitle(f"grammar engines, {report['n_logits']} logits, {report['rounds']} rounds (medians)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
