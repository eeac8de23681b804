"""Summaries and the printed table of ``edge-agent bench llm`` (the runs themselves are in ``llm.py``)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..metrics.timing import LatencyStats, RequestTiming
from .options import LLMOptions

if TYPE_CHECKING:
    from ..config import LLMTierConfig
    from ..engines.resolve import Resolved
    from ..serving.llm.scheduler import Limits


class ServedTier(Protocol):
    """What the report says of the measured tier (``llm.Served`` is one)."""

    tier: LLMTierConfig
    resolved: Resolved
    limits: Limits
    threads: int
    config: Any

    def header(self) -> str: ...


STAT_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def _new_stats() -> LatencyStats:
    return LatencyStats(window_s=1e9, max_samples=10_000_000)


def summarize(timings: Sequence[RequestTiming], wall_s: float, sla_ms: float, batch1: bool) -> dict:
    stats = _new_stats()
    for t in timings:
        stats.add(t)
    summary = stats.summary()
    out: dict = {m: summary[m] for m in STAT_METRICS}
    tokens = sum(t.tokens_out for t in timings)
    good = sum(1 for t in timings if t.ttft_ms is not None and t.ttft_ms <= sla_ms)
    out["requests"] = len(timings)
    out["tokens_out"] = tokens
    out["wall_s"] = wall_s
    out["tokens_per_s"] = tokens / wall_s
    out["requests_per_s"] = len(timings) / wall_s
    out["goodput"] = good / wall_s
    out["sla_met"] = good
    itl50 = summary["itl_ms"]["p50"]
    out["decode_tokens_per_s"] = 1e3 / itl50 if batch1 and itl50 else None
    return out


def _median_of(rounds: list[dict]) -> dict:
    """Field-wise median across rounds (nested stat dicts included); counts are per round."""
    first = rounds[0]
    merged: dict = {}
    for key, value in first.items():
        if isinstance(value, dict):
            merged[key] = _median_of([r[key] for r in rounds])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rounds if r[key] is not None]
            med = statistics.median(values) if values else None
            counted = key in ("count", "requests", "tokens_out", "sla_met")
            merged[key] = int(med) if isinstance(value, int) and med is not None and counted else med
        else:
            values = [r[key] for r in rounds if r[key] is not None]
            merged[key] = statistics.median(values) if values else None
    return merged


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def side_summary(rounds: list[dict], mode: str | None = None) -> dict:
    """A side's medians across rounds, with each round's tokens/s (and how the side ran, when given)."""
    side = _median_of(rounds)
    side["per_round_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
    if mode is not None:
        side["mode"] = mode
    return side


def baseline_mode(stateful: bool) -> str:
    """How the baseline ran: one request at a time, through the stateful session for a stateful model."""
    return "sequential, one request at a time, bare DecoderLM.generate_greedy loop" + (
        " through the stateful session (one sequence, its KV cache in the infer request)" if stateful else ""
    )


def c1_ratios(agent: dict, baseline: dict | None) -> tuple[float | None, float | None]:
    """At concurrency 1: the agent's TTFT p50 over the baseline's (overhead) and its decode tokens/s over the
    baseline's; both None without a baseline."""
    if baseline is None:
        return None, None
    return (
        _ratio(agent["ttft_ms"]["p50"], baseline["ttft_ms"]["p50"]),
        _ratio(agent["decode_tokens_per_s"], baseline["decode_tokens_per_s"]),
    )


def scaling_summary(k: int | None, k_rounds: list[dict], agent: dict) -> dict | None:
    """The agent at concurrency ``k`` (``--scaling``) and its tokens/s and TTFT ratios to ``agent``'s."""
    if not k_rounds:
        return None
    at_k = _median_of(k_rounds)
    return {
        "concurrency": k,
        "agent": at_k,
        "tokens_per_s_ratio": _ratio(at_k["tokens_per_s"], agent["tokens_per_s"]),
        "ttft_p50_ratio": _ratio(at_k["ttft_ms"]["p50"], agent["ttft_ms"]["p50"]),
        "ttft_p99_ratio": _ratio(at_k["ttft_ms"]["p99"], agent["ttft_ms"]["p99"]),
    }


def report_notes(opts: LLMOptions, limits: Limits, tier_max_new_tokens: int, baseline, genai, ov_side) -> list[str]:
    """What a reader must know to read the figures: ratios that C or open-loop arrivals make meaningless, peers
    that run one request at a time, the batching wait in the agent's TTFT, the tier's own token cap."""
    C, T = opts.concurrency, opts.max_new_tokens
    out = []
    if baseline is not None:
        if C == 1:
            if opts.rate is not None:
                out.append(
                    "open loop (Poisson): agent TTFT includes queueing behind earlier requests, "
                    "so overhead_ratio mixes load with agent overhead"
                )
        else:
            out.append(
                "overhead_ratio and decode_ratio are defined at concurrency 1 only "
                "(the baseline runs one request at a time)"
            )
    if genai is not None and C > 1:
        out.append("genai runs one request at a time (like the baseline): compare its ratios at C=1")
    if ov_side is not None and C > 1:
        out.append("openvino-genai runs one request at a time: compare its ratios at C=1")
    if limits.max_batch > 1 and limits.batch_timeout_ms > 0 and 1 not in limits.preferred_batch_sizes:
        how = "only when one is expected soon (adaptive_wait)" if limits.adaptive else "always (adaptive_wait = false)"
        out.append(
            f"a request that finds the device idle waits up to batch_timeout_ms ({limits.batch_timeout_ms:g}) for "
            f"batch-mates, {how}, as in the daemon: agent TTFT (and overhead_ratio) include that wait"
        )
    if tier_max_new_tokens < T:
        out.append(f"the daemon caps this tier at max_new_tokens {tier_max_new_tokens}; this run made {T}")
    return out


def setup_section(opts: LLMOptions, served: ServedTier, ramp_s: float) -> dict:
    """The report's first part: what was measured and how (tier, engine, load, limits)."""
    return {
        "header": served.header(),
        "tier": served.tier.name,
        "config": served.config,
        "engine": served.resolved.identity,
        "model": served.resolved.ref.name,
        "backend": served.tier.backend,
        "device": served.tier.device,
        "threads": served.threads,
        "concurrency": opts.concurrency,
        "requests": opts.requests,
        "rate": opts.rate,
        "arrivals": "poisson" if opts.rate is not None else "closed-loop",
        "prompt_tokens": opts.prompt_tokens,
        "max_new_tokens": opts.max_new_tokens,
        "sla_ms": opts.sla_ms,
        "rounds": {"count": opts.rounds, "aggregation": "median across rounds, agent, baseline and genai alternating"},
        "ramp_s": ramp_s,
        "limits": dataclasses.asdict(served.limits),
    }


def _rate_text(rate: float | None) -> str:
    return "" if rate is None else f" at {rate:g}/s"


def _fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def format_table(report: dict) -> str:
    a, b, g = report["agent"], report["baseline"], report["genai"]
    lines = [
        f"LLM bench: {report['model']} on {report['backend']} ({report['threads']} threads), "
        f"C={report['concurrency']}, {report['requests']} requests × {report['rounds']['count']} rounds, "
        f"{report['arrivals']}{_rate_text(report['rate'])}, "
        f"P={report['prompt_tokens']} T={report['max_new_tokens']}",
        f"{'metric':<22}{'agent':>12}{'baseline':>12}{'agent/base':>12}"
        + (f"{'genai':>12}{'agent/genai':>12}" if g else ""),
    ]

    def row(name: str, av, bv, gv) -> None:
        line = f"{name:<22}{_fmt(av):>12}{_fmt(bv):>12}{_fmt(_ratio(av, bv), 2):>12}"
        if g:
            line += f"{_fmt(gv):>12}{_fmt(_ratio(av, gv), 2):>12}"
        lines.append(line)

    for m in STAT_METRICS:
        for p in ("p50", "p95", "p99"):
            row(f"{m} {p}", a[m][p], b[m][p] if b else None, g[m][p] if g else None)
    for k in ("tokens_per_s", "requests_per_s", "goodput", "decode_tokens_per_s"):
        row(k, a[k], b[k] if b else None, g[k] if g else None)
    lines.append(
        f"overhead_ratio (TTFT p50, C=1): {_fmt(report['overhead_ratio'], 3)}   "
        f"decode_ratio: {_fmt(report['decode_ratio'], 3)}"
    )
    r = report["roofline"]
    lines.append(
        f"roofline: {r['bandwidth_gb_s']:.1f} GB/s read, {r['bytes_per_token'] / 1e6:.1f} MB/token → "
        f"bound {r['bound_tokens_per_s']:.0f} tok/s; achieved {_fmt(r['achieved_tokens_per_s'])} "
        f"({r['achieved_source']}) = {_fmt(r['fraction'], 2)} of the bound"
        + (f", onnxruntime-genai {r['genai_fraction']:.2f}" if r.get("genai_fraction") is not None else "")
        + f" [bandwidth: {r.get('bandwidth_method', 'numpy-sum')}]"
    )
    if g is None:
        lines.append(f"genai: {report['genai_reason']}")
    else:
        lines.append(f"genai: {g['folder']}; greedy token agreement with the bare loop {g['token_agreement']:.2f}")
        paired = g["agent_over_genai"].get("decode_per_round")
        if paired:
            rounds = paired["rounds"]
            lines.append(
                f"agent/genai decode tokens/s per round: median ×{paired['median']:.2f} "
                f"[{min(rounds):.2f}–{max(rounds):.2f}] over {len(rounds)} rounds"
            )
    sc = report.get("scaling")
    if sc:
        lines.append(
            f"scaling C={report['concurrency']} → C={sc['concurrency']}: "
            f"tokens/s ×{_fmt(sc['tokens_per_s_ratio'], 2)}"
            f" ({_fmt(report['agent']['tokens_per_s'])} → {_fmt(sc['agent']['tokens_per_s'])}), TTFT p99 "
            f"×{_fmt(sc['ttft_p99_ratio'], 2)} ({_fmt(report['agent']['ttft_ms']['p99'])} → "
            f"{_fmt(sc['agent']['ttft_ms']['p99'])} ms), TTFT p50 ×{_fmt(sc['ttft_p50_ratio'], 2)}"
        )
    if report["ramp_s"]:
        lines.append(f"closed-loop clients started {report['ramp_s'] / report['concurrency'] * 1e3:.0f} ms apart")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
