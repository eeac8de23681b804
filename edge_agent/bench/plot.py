"""Plots of bench reports: the shared helpers (``pyplot``: matplotlib headless, or a one-line error; ``cdf``:
one empirical CDF), and the LLM report (TTFT and ITL CDFs, agent vs baseline, and tokens/s bars)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed); without matplotlib, an ``InputError``
    that says what to install."""
    try:
        import matplotlib
    except ImportError as exc:
        raise InputError("--plot needs matplotlib: pip install 'edge-agent[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf(ax, values, label: str) -> None:
    """Draw the empirical CDF of ``values`` on ``ax`` (nothing for no values)."""
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_report(report: dict, raw: dict, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "Inter-token latency")):
        for side in ("agent", "baseline", "genai"):
            cdf(ax, raw.get(side, {}).get(metric, []), side)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{title} CDF (all rounds)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    if report.get("sla_ms"):
        axes[0].axvline(report["sla_ms"], color="red", linestyle="--", linewidth=1)
    names, values = ["agent"], [report["agent"]["tokens_per_s"]]
    if report.get("baseline"):
        names.append("baseline")
        values.append(report["baseline"]["tokens_per_s"])
    if report.get("genai"):
        names.append("onnxruntime-genai")
        values.append(report["genai"]["tokens_per_s"])
    roof = report.get("roofline") or {}
    if roof.get("bound_tokens_per_s"):
        names.append("bandwidth bound\n(batch 1)")
        values.append(roof["bound_tokens_per_s"])
    palette = {"agent": "tab:blue", "baseline": "tab:orange", "onnxruntime-genai": "tab:green"}
    bars = axes[2].bar(names, values, color=[palette.get(n, "tab:gray") for n in names])
    axes[2].bar_label(bars, fmt="%.0f")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_title(f"Throughput, C={report['concurrency']}")
    fig.suptitle(
        f"{report['model']} · {report['backend']} · {report['threads']} threads · "
        f"P={report['prompt_tokens']} T={report['max_new_tokens']} · {report['arrivals']}"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
