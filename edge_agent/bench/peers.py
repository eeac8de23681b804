"""Figures and the comparison table of ``scripts/bench-peers`` (edge-agent against other LLM runtimes).

The driver (scripts/bench_peers.py) runs every engine in interleaved rounds and hands each run's raw
figures here: per (model, engine, figure) one value per round. This module reduces them to medians with
min–max spreads, computes the ratios edge-agent / peer and formats the one table the docs show. Pure
Python, no engine imports: the peers' packages never enter the runtime.

Figures (all at the same thread count, on the same weights):
- ``decode_tps``: batch-1 decode tokens/s = 1000 / median inter-token latency of one request at a time;
- ``prefill_tps``: prompt tokens / median TTFT of one request at a time (the prompt pass plus one token);
- ``c4_ttft_ms``: median TTFT with C closed-loop clients;
- ``c4_tps``: generated tokens / wall time with C clients.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

AGENT = "edge-agent"
FIGURES = ("decode_tps", "prefill_tps", "c4_ttft_ms", "c4_tps")
HEADINGS = {
    "decode_tps": "decode tok/s (batch 1)",
    "prefill_tps": "prefill tok/s",
    "c4_ttft_ms": "TTFT p50 ms (C=4)",
    "c4_tps": "tok/s (C=4)",
}
LOWER_IS_BETTER = frozenset({"c4_ttft_ms"})


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def single_figures(ttft_ms: Sequence[float], itl_ms: Sequence[float], prompt_tokens: int) -> dict[str, float]:
    """Batch-1 figures from one run's per-request TTFTs and all its inter-token gaps."""
    if not ttft_ms or not itl_ms:
        raise ValueError("single_figures: a run without requests or without inter-token gaps")
    return {"decode_tps": 1000.0 / median(itl_ms), "prefill_tps": prompt_tokens / (median(ttft_ms) / 1000.0)}


def concurrent_figures(ttft_ms: Sequence[float], tokens: int, wall_s: float) -> dict[str, float]:
    """C>1 figures from one run: the median TTFT and generated tokens per second of wall time."""
    if not ttft_ms or wall_s <= 0:
        raise ValueError("concurrent_figures: a run without requests or without wall time")
    return {"c4_ttft_ms": median(ttft_ms), "c4_tps": tokens / wall_s}


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median and min–max over rounds."""
    return {"median": median(values), "min": float(min(values)), "max": float(max(values)), "n": len(values)}


def summarize(rounds: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]]) -> dict:
    """``rounds[model][engine][figure]`` = per-round values → the same nesting of spreads, plus per peer
    ``ratio[figure]`` = edge-agent median / the peer's median (None where either side is missing)."""
    out: dict = {}
    for model, engines in rounds.items():
        out[model] = {}
        for engine, figures in engines.items():
            out[model][engine] = {f: spread(v) for f, v in figures.items() if v}
        agent = out[model].get(AGENT, {})
        for engine, figures in out[model].items():
            if engine == AGENT:
                continue
            figures["ratio"] = {
                f: (agent[f]["median"] / figures[f]["median"] if f in agent and f in figures else None) for f in FIGURES
            }
    return out


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def cell(figure: Mapping | None, ratio: float | None = None, reason: str | None = None) -> str:
    """``median [min–max]``, then ``×ratio`` (edge-agent / this engine) on peer rows."""
    if figure is None:
        return reason or "—"
    text = f"{_num(figure['median'])} [{_num(figure['min'])}–{_num(figure['max'])}]"
    return text if ratio is None else f"{text} ×{ratio:.2f}"


def format_table(
    summary: Mapping,
    engines: Iterable[str],
    reasons: Mapping[tuple[str, str], Mapping[str, str]] | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """The Markdown table: one row per (model, engine); ``reasons[(model, engine)][figure]`` fills a cell
    that was not measured (an engine that cannot be built, a figure it cannot run)."""
    reasons = reasons or {}
    engines = list(engines)
    head = ["model", "engine", *(HEADINGS[f] for f in FIGURES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, measured in summary.items():
        for engine in engines:
            figs = measured.get(engine, {})
            why = reasons.get((model, engine), {})
            ratio = figs.get("ratio", {}) if engine != AGENT else {}
            cells = [cell(figs.get(f), ratio.get(f), why.get(f) or why.get("*")) for f in FIGURES]
            lines.append("| " + " | ".join([(labels or {}).get(model, model), engine, *cells]) + " |")
    return "\n".join(lines)
