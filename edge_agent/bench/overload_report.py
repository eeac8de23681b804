"""``bench overload``'s report: the markdown table (median over the rounds, min–max beside it), the issue's
targets checked against the medians, and the plot (goodput, admitted TTFT P95 and refused share against
the offered load, the daemon beside llama.cpp's server)."""

from __future__ import annotations

from pathlib import Path

EDGE, LLAMA = "edge-agent", "llama.cpp"

LOAD_FOR_TARGETS = 1.5  # the demo's burst


def _level(report: dict, system: str, load: float) -> dict | None:
    for row in report["systems"].get(system, {}).get("levels", []):
        if abs(row["load"] - load) < 1e-9:
            return row
    return None


def _median(row: dict | None, key: str) -> float | None:
    got = (row or {}).get(key)
    return got["median"] if got else None


def cell(stat: dict | None, scale: float = 1.0, digits: int = 0) -> str:
    """``median`` or ``median (min–max)`` of a spread; ``—`` when nothing was measured."""
    if not stat:
        return "—"
    f = lambda v: f"{v * scale:.{digits}f}"  # noqa: E731
    if stat["n"] < 2 or f(stat["min"]) == f(stat["max"]):
        return f(stat["median"])
    return f"{f(stat['median'])} ({f(stat['min'])}–{f(stat['max'])})"


def check_targets(report: dict) -> list[dict]:
    """The issue's targets against the medians of the rounds: ``{"target", "value", "met"}`` (``met`` None
    where nothing was measured)."""
    sla = report["sla_ms"]
    hi, low, one = (_level(report, EDGE, x) for x in (LOAD_FOR_TARGETS, 0.5, 1.0))
    out: list[dict] = []

    def add(target: str, value: float | None, ok, unit: str = "ms", digits: int = 0) -> None:
        shown = "—" if value is None else f"{value:.{digits}f}{' ' + unit if unit else ''}"
        out.append({"target": target, "value": shown, "met": None if value is None else bool(ok(value))})

    add(f"1.5x: admitted TTFT P95 <= {sla:g} ms", _median(hi, "ttft_p95_ms"), lambda v: v <= sla)
    add("1.5x: admitted TTFT P99 <= 800 ms", _median(hi, "ttft_p99_ms"), lambda v: v <= 800)
    add("1.5x: refusals answered P95 <= 50 ms", _median(hi, "refusal_p95_ms"), lambda v: v <= 50)
    bound = (1 - 1 / LOAD_FOR_TARGETS) + 0.10
    share = _median(hi, "refused_share")
    add(
        f"1.5x: refused share <= {bound * 100:.0f} % (1 - capacity/offered + 10 points)",
        None if share is None else 100 * share,
        lambda v: v <= bound * 100 + 1e-9,
        "%",
    )
    if hi is not None:
        missing = sum(r.get("refused_without_retry_after") or 0 for r in _rounds_at(report, LOAD_FOR_TARGETS))
        add("1.5x: every refusal carries Retry-After (refusals without it)", float(missing), lambda v: v == 0, "")
    add("0.5x: nothing refused (refused, all rounds)", None if low is None else float(low["total_refused"]),
        lambda v: v == 0, "")  # fmt: skip
    accounted = [row["accounted"] for row in report["systems"].get(EDGE, {}).get("levels", [])]
    add("every request accounted (levels where sent != the sum)", float(accounted.count(False)) if accounted else None,
        lambda v: v == 0, "")  # fmt: skip
    g1 = _median(one, "goodput_per_s")
    for load in (2.0, 3.0):
        g = _median(_level(report, EDGE, load), "goodput_per_s")
        ratio = None if g is None or not g1 else g / g1
        add(f"{load:g}x: goodput >= 0.9x goodput at 1x (ratio)", ratio, lambda v: v >= 0.9, "", 2)
    delays = [
        lvl["switch_delay_s"]
        for rounds in report["systems"].get(EDGE, {}).get("rounds", [])
        for lvl in rounds
        if lvl.get("switch_delay_s") is not None
    ]
    add("a switch down <= 3 s after the first arrival predicted over budget (the slowest)",
        max(delays) if delays else None, lambda v: v <= 3.0, "s", 1)  # fmt: skip
    add("1.5x: spoken command end of speech -> reply P95 <= 500 ms", _median(hi, "voice_p95_ms"), lambda v: v <= 500)
    add("1.5x: spoken commands refused (all rounds)", None if hi is None or not hi["total_voice_turns"]
        else float(hi["total_voice_refused"]), lambda v: v == 0, "")  # fmt: skip
    return out


def _rounds_at(report: dict, load: float) -> list[dict]:
    rounds = report["systems"].get(EDGE, {}).get("rounds", [])
    return [lvl for per_round in rounds for lvl in per_round if abs(lvl["load"] - load) < 1e-9]


def _rounds_text(report: dict) -> str:
    counts = {system: len(data.get("rounds", [])) for system, data in report["systems"].items()}
    if len(set(counts.values())) > 1:
        return ", ".join(f"{n} round(s) of {system}" for system, n in counts.items())
    return f"{report['rounds']} round(s)"


def _load_range(report: dict) -> str:
    loads = [
        lvl["load_avg_1m"]
        for data in report["systems"].values()
        for per_round in data["rounds"]
        for lvl in per_round
        if lvl.get("load_avg_1m") is not None
    ]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"


def table(report: dict) -> list[str]:
    """The per-level markdown table: the daemon's figures, then llama.cpp's where it ran."""
    llama = LLAMA in report["systems"]
    head = ["load", "offered/s", "sent = done + refused + cancelled + failed", "goodput/s", "TTFT P50 ms",
            "TTFT P95 ms", "TTFT P99 ms", "refused %", "refusal P50 / P95 ms",
            "voice turn P95 ms (final / first token P95)"]  # fmt: skip
    if llama:
        head += ["llama.cpp goodput/s", "llama.cpp TTFT P50 / P95 / P99 ms", "llama.cpp not completed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["systems"][EDGE]["levels"]:
        acc = (
            f"{row['total_sent']} = {row['total_completed']} + {row['total_refused']} + "
            f"{row['total_cancelled']} + {row['total_failed']}"
        )
        cells = [
            f"{row['load']:g}x",
            f"{row['offered_per_s']:.2f}",
            acc,
            cell(row.get("goodput_per_s"), digits=2),
            cell(row.get("ttft_p50_ms")),
            cell(row.get("ttft_p95_ms")),
            cell(row.get("ttft_p99_ms")),
            cell(row.get("refused_share"), 100),
            f"{cell(row.get('refusal_p50_ms'))} / {cell(row.get('refusal_p95_ms'))}",
            (
                f"{cell(row.get('voice_p95_ms'))} ({cell(row.get('voice_final_p95_ms'))} / "
                f"{cell(row.get('voice_first_token_p95_ms'))}), n={row['total_voice_turns']}"
            )
            if row["total_voice_turns"]
            else "—",
        ]
        if llama:
            other = _level(report, LLAMA, row["load"]) or {}
            cells += [
                cell(other.get("goodput_per_s"), digits=2),
                " / ".join(cell(other.get(k)) for k in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")),
                f"{other.get('total_cancelled', 0)} cancelled + {other.get('total_failed', 0)} failed of "
                f"{other.get('total_sent', 0)}"
                if other
                else "—",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"capacity {report['capacity_per_s']:.2f} chats/s ({report['capacity_source']}; the daemon completed "
        f"{report['capacity_measured_per_s']:.2f}/s with 4 in flight); {_rounds_text(report)} of "
        f"{report['seconds']:g} s per level; SLA {report['sla_ms']:g} ms; seed {report['seed']}",
        f"machine: {m['cpu']}, {m['cores']} cores; 1-min load average {m['load_avg_at_start'][0]:.1f} at the start, "
        f"{_load_range(report)} at the levels' ends",
    ]
    lines += [f"daemon: {line}" for line in report.get("daemon_serving", [])]
    if report.get("voices"):
        lines.append(f"spoken commands: the demo's, in {', '.join(report['voices'])}")
    if report.get("machine_before"):
        lines.append(
            "(systems kept from an earlier run, started at a 1-min load average of "
            f"{report['machine_before']['load_avg_at_start'][0]:.1f})"
        )
    if "llamacpp" in report:
        lc = report["llamacpp"]
        lines.append(
            f"llama.cpp: `{lc['command']}` on {lc['gguf']}; {lc.get('slots', 4)} slot(s); it completed "
            f"{lc['capacity_per_s']:.2f} chats/s with 4 in flight"
        )
    lines += ["", *table(report), ""]
    lines.append("Median over the rounds (min–max); counts are totals over the rounds.")
    lines += ["", "| target | median | met |", "|---|---|---|"]
    for t in report["targets"]:
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['value']} | {met} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    """Goodput, admitted TTFT P95 and refused share against the offered load (median, min–max bars)."""
    from .plot import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {EDGE: ("tab:blue", "o"), LLAMA: ("tab:orange", "s")}
    panels = (
        ("goodput_per_s", 1.0, "goodput (chats/s with TTFT <= SLA)"),
        ("ttft_p95_ms", 1.0, "admitted TTFT P95 (ms, log)"),
        ("refused_share", 100.0, "refused (% of sent)"),
    )
    for ax, (key, scale, title) in zip(axes, panels, strict=True):
        for system, data in report["systems"].items():
            xs, ys, lo, hi = [], [], [], []
            for row in data["levels"]:
                stat = row.get(key)
                if stat:
                    xs.append(row["load"])
                    ys.append(stat["median"] * scale)
                    lo.append((stat["median"] - stat["min"]) * scale)
                    hi.append((stat["max"] - stat["median"]) * scale)
            if xs:
                color, marker = styles.get(system, ("tab:gray", "^"))
                ax.errorbar(xs, ys, yerr=[lo, hi], color=color, marker=marker, capsize=3, label=system)
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_xlim(0.3, 3.2)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].plot([0, 3], [0, 3 * report["capacity_per_s"]], color="gray", linestyle=":", linewidth=1, label="offered")
    axes[0].axhline(report["capacity_per_s"], color="gray", linestyle="--", linewidth=1, label="measured capacity")
    axes[1].set_yscale("log")
    xs = [1 + k / 20 for k in range(41)]
    axes[2].plot(
        xs, [100 * (1 - 1 / x) for x in xs], color="gray", linestyle=":", linewidth=1, label="1 - capacity/offered"
    )
    axes[1].axhline(report["sla_ms"], color="red", linestyle="--", linewidth=1, label="SLA")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(
        f"bench overload · capacity {report['capacity_per_s']:.2f} chats/s · {report['seconds']:g} s per level · "
        f"{_rounds_text(report)} · {report['machine']['cores']} cores"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
