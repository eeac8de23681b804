"""The build/calibrate report that decides: a verdict line, then one row per candidate.

Every row carries its metrics next to the recipe's budget, its median latency beside the paired FP32
timing its speed ratio is taken against (so ``ms`` and ``speed`` never disagree), the times that
apply to it (calibration only where calibration ran), and, for every row not chosen, why. Skipped
precisions are rows of their own in the text and entries in the JSON. ``decide`` returns the JSON;
``render`` turns that same JSON into the text, so the two cannot say different things.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import gate as gates
from .gate import Verdict
from .recipes import WEIGHT_ONLY

_QUANTIZED = ("int8", *WEIGHT_ONLY)

LEGEND = {
    "llm": "cosine: mean logits cosine with FP32; top-1: share of steps whose next token agrees with FP32's; "
    "KL: mean KL(FP32 || candidate) per step, nats",
    "llm-ppl": "cosine: mean logits cosine with FP32; top-1: share of steps whose next token agrees with FP32's; "
    "KL: mean KL(FP32 || candidate) per step, nats; ppl: perplexity on the recipe's held-out text and its "
    "change over FP32's (Δppl); greedy: share of the text's scored tokens whose argmax is FP32's",
    "asr": "WER: word error rate against the reference transcripts; ΔWER: minus FP32's WER, against the budget; "
    "agree: share of utterances whose text is identical to FP32's (reported, not gated)",
}
TIMING = (
    "ms: median latency per held-out sample; fp32 ms: the FP32 source timed interleaved with that "
    "candidate (same samples, same rounds); speed = fp32 ms / ms"
)
TIMING_LLM = (
    "tok/s: batch-1 greedy decode with the KV cache (median ms/token over interleaved rounds of held-out "
    "prompts); fp32 tok/s: the FP32 source decoding in the same rounds; speed = tok/s / fp32 tok/s (the gate "
    "chooses by it); prefill: the prompts' forward pass, paired the same way, fp32 ms / ms; bytes/tok: weight "
    "bytes read per decoded token (the engine's weights as stored, embedding gathers excluded)"
)


def name_of(v: Verdict) -> str:
    return f"{v.backend}/{v.precision}" + (f" {v.flavour}" if v.flavour else "")


def source_verdicts(verdicts: Sequence[Verdict], workload: str) -> list[Verdict]:
    """The FP32 source model itself as a candidate, once per backend (its latency is the paired reference
    each gate measured), so a quantized engine has to beat it to be chosen."""
    out = []
    for backend in dict.fromkeys(v.backend for v in verdicts):
        mine = [v for v in verdicts if v.backend == backend and v.reference_latency_ms]
        if not mine:
            continue
        lat = sorted(v.reference_latency_ms or 0.0 for v in mine)[len(mine) // 2]
        if workload == "llm":
            metrics = {"cosine": 1.0, "top1": 1.0, "kl": 0.0}
            fp32_ppl = mine[0].metrics.get("perplexity_fp32")
            if fp32_ppl is not None:
                metrics |= {"perplexity": fp32_ppl, "perplexity_fp32": fp32_ppl, "ppl_increase_pct": 0.0}
                metrics |= {"greedy_agreement": 1.0}
        else:
            wer = mine[0].metrics.get("wer_fp32", 0.0)
            metrics = {"wer": wer, "wer_fp32": wer, "wer_delta": 0.0, "text_agreement": 1.0}
        rungs = dict.fromkeys(mine[0].rungs, True)  # the source is within every rung's budget
        out.append(Verdict("fp32", backend, metrics, dict(mine[0].budget), True, [], lat, lat, "source", rungs))
    return out


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v)
    return values[len(values) // 2] if values else None


def source_extras(rows: Sequence[dict], backend: str) -> dict[str, Any]:
    """The FP32 source's own decode rate, prefill and weight bytes, from the pairings its candidates measured."""
    mine = [r["accuracy"] for r in rows if r.get("accuracy") and r["accuracy"].get("backend") == backend]
    tok_s = _median([a.get("reference_decode_tok_s") or 0.0 for a in mine])
    prefill = _median([a.get("reference_prefill_ms") or 0.0 for a in mine])
    return {
        "timing": next((a.get("timing") for a in mine if a.get("timing")), None),
        "decode_tok_s": tok_s,
        "reference_decode_tok_s": tok_s,
        "prefill_ms": prefill,
        "reference_prefill_ms": prefill,
        "weight_bytes": _median([a.get("reference_weight_bytes") or 0 for a in mine]),
        "reference_weight_bytes": _median([a.get("reference_weight_bytes") or 0 for a in mine]),
    }


def speed_facts(acc: dict[str, Any]) -> dict[str, Any]:
    """Decode rate, prefill speed and bytes per token of a row (None where not measured: ASR, old entries)."""
    prefill, ref_prefill = acc.get("prefill_ms"), acc.get("reference_prefill_ms")
    return {
        "timing": acc.get("timing"),
        "decode_tok_s": acc.get("decode_tok_s"),
        "reference_decode_tok_s": acc.get("reference_decode_tok_s"),
        "prefill_speedup": ref_prefill / prefill if prefill and ref_prefill else None,
        "bytes_per_token": acc.get("weight_bytes"),
        "reference_bytes_per_token": acc.get("reference_weight_bytes"),
    }


def checks(v: Verdict, workload: str) -> dict[str, str]:
    """Each gated metric next to its budget, with the comparison that held or broke ("0.9952 ≥ 0.995")."""
    m, b = v.metrics, v.budget
    if workload == "llm":
        out = {"cosine": f"{m['cosine']:.4f}", "top-1": f"{m['top1']:.3f}", "KL": f"{m['kl']:.4f}"}
        if "min_cosine" in b:
            out["cosine"] += f" {'≥' if m['cosine'] >= b['min_cosine'] else '<'} {b['min_cosine']}"
        if "min_top1" in b:
            out["top-1"] += f" {'≥' if m['top1'] >= b['min_top1'] else '<'} {b['min_top1']}"
        if "max_kl" in b:
            out["KL"] += f" {'≤' if m['kl'] <= b['max_kl'] else '>'} {b['max_kl']}"
        if "ppl_increase_pct" in m:
            pct = m["ppl_increase_pct"]
            out["ppl"] = f"{m['perplexity']:.3f} {pct:+.2f}%"
            if "max_ppl_increase_pct" in b:
                out["ppl"] += f" {'≤' if pct <= b['max_ppl_increase_pct'] else '>'} {b['max_ppl_increase_pct']}%"
            out["greedy"] = f"{m['greedy_agreement']:.3f}"
            if "min_greedy_agreement" in b:
                ok = m["greedy_agreement"] >= b["min_greedy_agreement"]
                out["greedy"] += f" {'≥' if ok else '<'} {b['min_greedy_agreement']}"
        return out
    out = {"WER": f"{m['wer']:.3f}", "ΔWER": f"{m['wer_delta']:+.3f}", "agree": f"{m['text_agreement']:.3f}"}
    if "max_wer_delta" in b:
        out["ΔWER"] += f" / {b['max_wer_delta']}"
    return out


def _why_not(v: Verdict, chosen: Verdict | None, target: str) -> str:
    if not v.passed:
        return "refused: " + "; ".join(v.reasons)
    if not v.passes():  # within a lower rung's budget only
        return "lower rung only: " + "; ".join(v.reasons)
    if chosen is None:
        return "reference only: no engine passed, the model folder serves" if v.flavour == "source" else ""
    speed, best = v.speedup or 0.0, chosen.speedup or 0.0
    if v.precision in _QUANTIZED and chosen.precision not in _QUANTIZED:
        return (
            f"within budget but {speed:.2f}x as fast as FP32 here; a quantized engine is chosen only when "
            f"faster than {name_of(chosen)} ({best:.2f}x)"
        )
    if v.flavour == "source":
        return f"{name_of(chosen)} is faster ({best:.2f}x)"
    if v.precision == "fp16":
        return f"{speed:.2f}x, not faster than {name_of(chosen)} ({best:.2f}x) on this {target}"
    return f"{speed:.2f}x, slower than {name_of(chosen)} ({best:.2f}x)"


def _times(report: dict | None) -> dict[str, float | None]:
    if report is None:  # the FP32 source: nothing was built
        return {"build_s": None, "calibration_s": None, "load_ms": None}
    if report.get("cache") == "hit":  # nothing was built or calibrated by this command
        return {"build_s": None, "calibration_s": None, "load_ms": report.get("load_ms")}
    conv = report.get("conversion") or {}
    calibrated = report.get("precision") == "int8" and report.get("flavour") not in ("dynamic", "weights")
    return {
        "build_s": report.get("build_s"),
        "load_ms": report.get("load_ms"),
        "calibration_s": conv.get("seconds") if calibrated else None,
    }


def verdict_line(rows: list[dict], target: str) -> str:
    chosen = next((r for r in rows if r["chosen"]), None)
    built = [r for r in rows if r["flavour"] != "source"]
    refused = [r for r in built if not r["passed"]]
    if chosen is None or (built and len(refused) == len(built)):
        why = "; ".join(f"{r_name(r)}: {r['reasons'][0]}" for r in refused if r["reasons"])
        return "chosen: none: every candidate was refused by the accuracy gate" + (f" ({why})" if why else "")
    others = []
    for r in built:
        if r["chosen"]:
            continue
        label = f"{r['precision'].upper()}" + "".join(f" {r[k]}" for k in ("flavour", "method") if r.get(k))
        rungs = r.get("rungs") or {}
        if not r["passed"]:
            others.append(f"{label} refused ({r['reasons'][0]})" if r["reasons"] else f"{label} refused")
        elif rungs and not rungs.get("top", False):
            lower = ", ".join(n for n, ok in rungs.items() if ok)
            others.append(f"{label} within the {lower} rung's budget only ({r['speedup'] or 0:.2f}x)")
        elif r["precision"] in _QUANTIZED:
            others.append(f"{label} within budget but {r['speedup'] or 0:.2f}x as fast here")
        else:
            others.append(f"{label} {r['speedup'] or 0:.2f}x, not faster on this {target}")
    if chosen["flavour"] == "source":
        head = f"chosen: {r_name(chosen)} (the model folder; no engine is faster here)"
    else:
        head = f"chosen: {r_name(chosen)} ({chosen['speedup'] or 0:.2f}x of FP32)"
    return head + (": " + "; ".join(others) if others else "")


def r_name(r: dict) -> str:
    name = f"{r['backend']}/{r['precision']}" + (f" {r['flavour']}" if r["flavour"] else "")
    return name + (f" {r['method']}" if r.get("method") else "")


def method_of(report: dict | None) -> str:
    """An int4 candidate's 4-bit method (``conversion.algorithm``), so candidates of one precision made
    differently (gptq, hqq, kquant) are told apart; "" for the rest, and for cache hits (no conversion)."""
    if not report or report.get("precision") != "int4":
        return ""
    return str((report.get("conversion") or {}).get("algorithm") or "")


def decide(
    reports: Sequence[dict], workload: str, target: str, skipped: Sequence[dict] = (), with_source: bool = True
) -> dict[str, Any]:
    """The report's facts as JSON: ``verdict``, ``chosen``, ``rows`` (one per candidate, FP32 source
    first), ``skipped`` ({candidate, why}), ``legend``; plus the raw ``engines`` reports."""
    measured = [r for r in reports if r.get("accuracy")]
    verdicts = [
        gates.Verdict(
            **{k: r["accuracy"][k] for k in ("precision", "backend", "metrics", "budget", "passed", "reasons")},
            latency_ms=r["accuracy"].get("latency_ms"),
            reference_latency_ms=r["accuracy"].get("reference_latency_ms"),
            flavour=r["accuracy"].get("flavour", ""),
            rungs=dict(r["accuracy"].get("rungs") or {}),
            weight_bytes=r["accuracy"].get("weight_bytes"),
        )
        for r in measured
    ]
    by_verdict: list[tuple[Verdict, dict | None]] = list(zip(verdicts, measured))
    if with_source:
        by_verdict = [(v, None) for v in source_verdicts(verdicts, workload)] + by_verdict
    chosen = gates.choose([v for v, _ in by_verdict])
    if verdicts and not any(v.passed for v in verdicts):
        chosen = None  # every engine refused: the FP32 source is a reference, not a choice
    rung_names = list(dict.fromkeys(n for v in verdicts for n in v.rungs))
    per_rung: dict[str, Any] = {}
    names = {id(v): name_of(v) + (f" {method_of(rep)}" if method_of(rep) else "") for v, rep in by_verdict}
    for rung in rung_names:  # a lower rung: the fastest within its own budget (the FP32 source is within all)
        pick = gates.choose([v for v, _ in by_verdict], rung)
        per_rung[rung] = None if pick is None or chosen is None else names[id(pick)]
    cpu_word = "CPU" if target == "cpu" else target
    rows = []
    for v, rep in by_verdict:
        rows.append(
            {
                "candidate": names[id(v)],
                "backend": v.backend,
                "precision": v.precision,
                "flavour": v.flavour,
                "method": method_of(rep),
                "metrics": v.metrics,
                "budget": v.budget,
                "checks": checks(v, workload),
                "passed": v.passed,
                "rungs": v.rungs,
                "reasons": v.reasons,
                "latency_ms": v.latency_ms,
                "reference_latency_ms": v.reference_latency_ms,
                "speedup": v.speedup,
                "chosen": v is chosen,
                "why_not_chosen": "" if v is chosen else _why_not(v, chosen, cpu_word),
                "cache": (rep or {}).get("cache"),
                **speed_facts(rep["accuracy"] if rep else source_extras(measured, v.backend)),
                **_times(rep),
            }
        )
    return {
        "verdict": verdict_line(rows, cpu_word),
        "chosen": chosen.to_dict() if chosen else None,
        "rungs": per_rung,
        "rows": rows,
        "skipped": list(skipped),
        "legend": [
            LEGEND[_legend(workload, rows)],
            TIMING_LLM if any(r["timing"] == "decode" for r in rows) else TIMING,
        ],
        "engines": list(reports),
        "table": [v.to_dict() for v, _ in by_verdict],
    }


def _with_ppl(rows: Sequence[dict]) -> bool:
    return any("ppl_increase_pct" in r["metrics"] for r in rows)


def _legend(workload: str, rows: Sequence[dict]) -> str:
    return "llm-ppl" if workload == "llm" and _with_ppl(rows) else workload


def _cell(x: float | None, fmt: str) -> str:
    return format(x, fmt) if x is not None else ""


def _bytes(n: float | None) -> str:
    if not n:
        return ""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _speed_cells(r: dict, decode: bool) -> str:
    speed = f"{r['speedup']:.2f}x" if r["speedup"] else ""
    if not decode:
        return f" {_cell(r['latency_ms'], '.2f'):>8} {_cell(r['reference_latency_ms'], '.2f'):>8} {speed:>6}"
    if r.get("timing") != "decode":  # an entry cached before decode was timed: only its prefill is known
        speed, prefill = "", f"{r['speedup']:.2f}x" if r["speedup"] else ""
    else:
        prefill = f"{r['prefill_speedup']:.2f}x" if r.get("prefill_speedup") else ""
    return (
        f" {_cell(r.get('decode_tok_s'), '.1f'):>8} {_cell(r.get('reference_decode_tok_s'), '.1f'):>10}"
        f" {speed:>6} {prefill:>7} {_bytes(r.get('bytes_per_token')):>9}"
    )


def render(report: dict[str, Any], workload: str) -> str:
    """The text of ``decide``'s JSON: verdict line, table, legend, skipped precisions."""
    cols = ["cosine", "top-1", "KL"] if workload == "llm" else ["WER", "ΔWER", "agree"]
    widths = [16, 13, 15] if workload == "llm" else [7, 14, 7]
    if workload == "llm" and _with_ppl(report["rows"]):  # the perplexity gate: Δppl and greedy agreement
        cols, widths = [*cols, "ppl", "greedy"], [*widths, 24, 14]
    decode = any(r.get("timing") == "decode" for r in report["rows"])
    timing_head = (
        f" {'tok/s':>8} {'fp32 tok/s':>10} {'speed':>6} {'prefill':>7} {'bytes/tok':>9}"
        if decode
        else f" {'ms':>8} {'fp32 ms':>8} {'speed':>6}"
    )
    head = (
        f"{'candidate':<26} "
        + " ".join(f"{c:<{w}}" for c, w in zip(cols, widths))
        + timing_head
        + f" {'build s':>8} {'calib s':>8} {'load ms':>8}  verdict"
    )
    rung_lines = [f"rung {name}: {pick or 'none within its budget'}" for name, pick in report.get("rungs", {}).items()]
    lines = [report["verdict"], *rung_lines, "", head, "-" * len(head)]
    for r in report["rows"]:
        verdict = "← chosen" if r["chosen"] else ("PASS, not chosen: " if r["passed"] else "") + r["why_not_chosen"]
        within = [n for n, ok in (r.get("rungs") or {}).items() if ok]
        if r.get("rungs") and r["flavour"] != "source":
            verdict += f" [within: {', '.join(within) or 'no rung'}]"
        lines.append(
            f"{r['candidate']:<26} "
            + " ".join(f"{r['checks'].get(c, ''):<{w}}" for c, w in zip(cols, widths))
            + _speed_cells(r, decode)
            + f" {_cell(r['build_s'], '.1f'):>8} {_cell(r['calibration_s'], '.1f'):>8}"
            f" {_cell(r['load_ms'], '.0f'):>8}  {verdict}"
        )
    for s in report["skipped"]:
        lines.append(f"{s['candidate']:<26} skipped: {s['why']}")
    lines += ["", *report["legend"]]
    for r in report["engines"]:
        if r.get("cache") in ("built", "hit"):
            lines.append(
                f"cached ({r['cache']}): {r['backend']}/{r['precision']} {r.get('key', '')[:12]} {r.get('path')}"
            )
    return "\n".join(lines)
