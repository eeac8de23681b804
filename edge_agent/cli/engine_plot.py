"""``--plot`` of ``build`` and ``calibrate``: accuracy against speed per candidate, the frontier at a glance.

One point per row of the report (the FP32 source at 1.0x): x is the speed against the paired FP32
timing, y the gated accuracy metric (logits cosine for an LLM, its Δperplexity in percent when the
recipe gates perplexity, ΔWER for speech), the budget as a dashed line, refused candidates as crosses
and the chosen one as a star.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from ..bench.plot import pyplot

_OFFSETS = ((8, 10), (8, -16), (-90, 22), (-90, -28))


def plot_decision(report: dict[str, Any], workload: str, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    metric, label, budget_key = (
        ("cosine", "logits cosine with FP32 (higher is better)", "min_cosine")
        if workload == "llm"
        else ("wer_delta", "ΔWER against FP32 (lower is better)", "max_wer_delta")
    )
    if workload == "llm" and any("ppl_increase_pct" in r["metrics"] for r in report["rows"]):
        metric, label = "ppl_increase_pct", "Δperplexity against FP32, % (lower is better)"
        budget_key = "max_ppl_increase_pct"
    budget = None
    for i, r in enumerate(report["rows"]):
        x, y = r.get("speedup"), r["metrics"].get(metric)
        if x is None or y is None:
            continue
        budget = r["budget"].get(budget_key, budget)
        style = (
            ("*", "tab:green", 220) if r["chosen"] else (("o", "tab:blue", 60) if r["passed"] else ("x", "tab:red", 60))
        )
        ax.scatter([x], [y], marker=style[0], color=style[1], s=style[2], zorder=3)
        # Labels take turns around their point: FP32 and FP16 often sit on top of each other.
        ax.annotate(
            r["candidate"] + (" (chosen)" if r["chosen"] else ""),
            (x, y),
            textcoords="offset points",
            xytext=_OFFSETS[i % len(_OFFSETS)],
            arrowprops={"arrowstyle": "-", "color": "gray", "linewidth": 0.5},
            fontsize=8,
        )
    if budget is not None:
        ax.axhline(budget, color="tab:red", linestyle="--", linewidth=1, label=f"budget {budget}")
        ax.legend(loc="best")
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.margins(x=0.15, y=0.1)
    ax.set_xlabel("speed against the paired FP32 timing (x)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    title = f"{report.get('recipe', '')} · {report.get('target', '')}\n" + "\n".join(
        textwrap.wrap(report["verdict"], 100)
    )
    ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
