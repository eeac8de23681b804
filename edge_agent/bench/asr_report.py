"""What ``edge-agent bench asr`` prints and plots: the streaming/one-pass table and the latency CDFs."""

from __future__ import annotations

from pathlib import Path


def fmt(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def format_table(report: dict) -> str:
    s, b = report["streaming"], report["baseline"]
    lines = [
        f"ASR bench: {report['model']} ({report['kind']}) on {report['backend']} ({report['threads']} threads), "
        f"{report['streams']} stream(s) × {report['utterances_per_stream']} utterances × "
        f"{report['rounds']} rounds; "
        f"audio: {report['audio']}",
        f"{'metric (median of rounds)':<30}{'streaming':>12}{'one pass':>12}",
    ]
    for metric, digits in (
        ("first_partial_ms", 1),
        ("first_prefix_ms", 1),
        ("first_text_ms", 1),
        ("final_ms", 1),
        ("rtf", 4),
    ):
        for stat in ("p50", "p95"):
            streamed, one_pass = fmt(s[metric][stat], digits), fmt(b[metric][stat], digits)
            lines.append(f"{metric + ' ' + stat:<30}{streamed:>12}{one_pass:>12}")
    bt = report["batching"]
    lines.append(
        f"batches {bt['batches']} (mean size {fmt(bt['mean_size'], 2)}, sizes {bt['sizes']}), "
        f"final text = one-pass text for {fmt((report['final_text_equal_fraction'] or 0) * 100, 0)}% "
        "of utterances"
    )
    return "\n".join(lines)


def plot_report(report: dict, raw: dict, path: Path) -> Path:
    from .plot import cdf, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in (
        (axes[0], "final_ms", "End of speech → final"),
        (axes[1], "first_text_ms", "First voiced audio → first text"),
    ):
        for side, label in (("streaming", "streaming"), ("baseline", "one pass")):
            cdf(ax, [r[metric] for r in raw[side] if r[metric] is not None], label)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of utterances")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    values = [report["streaming"]["rtf"]["p50"] or 0, report["baseline"]["rtf"]["p50"] or 0]
    bars = axes[2].bar(["streaming", "one pass"], values, color=["tab:blue", "tab:orange"])
    axes[2].bar_label(bars, fmt="%.4f")
    axes[2].set_ylabel("RTF (p50)")
    axes[2].set_title(f"Real-time factor, {report['streams']} stream(s)")
    fig.suptitle(f"{report['model']} · {report['backend']} · {report['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
