"""The accuracy gate: a candidate engine against the FP32 reference on held-out samples.

LLM metrics are per step (one teacher-forced position = one next-token prediction):
``cosine`` (mean logits cosine), ``top1`` (argmax agreement), ``kl`` (mean KL(FP32 || candidate),
nats). With a recipe's ``[perplexity]`` text also ``perplexity`` against FP32's (``ppl_increase_pct``)
and ``greedy_agreement`` (the share of scored tokens whose argmax is FP32's: where greedy decoding
would pick the same token); with a perplexity budget the logits metrics are then gated only where the
recipe sets them. ASR: ``wer`` of both against the reference transcripts and ``wer_delta``. A
candidate beyond the recipe's budget is refused, with the numbers that broke it.

``choose`` picks the engine to use among measured candidates: the fastest that passed (by latency
relative to its paired FP32 measurement where there is one), except
that INT8 (and INT4) win only when measured faster than every passing FP16/FP32 one: a quantized
engine that is not faster only costs accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .recipes import TOP_RUNG, WEIGHT_ONLY, AccuracyBudget


@dataclass(slots=True)
class Verdict:
    """The gate's answer for one candidate: its metrics against the budget, pass or refuse and why, latency."""

    precision: str
    backend: str
    metrics: dict[str, float]
    budget: dict[str, float]
    passed: bool
    reasons: list[str] = field(default_factory=list)
    latency_ms: float | None = None  # median per sample on this device
    reference_latency_ms: float | None = None
    flavour: str = ""  # e.g. "qdq-static", "dynamic", "nncf"
    # With lower rungs ([rungs.NAME]): per rung, within its budget ("top" is [accuracy]); empty otherwise.
    rungs: dict[str, bool] = field(default_factory=dict)
    weight_bytes: float | None = None  # weight bytes read per generated token (None: not measured)

    def passes(self, rung: str = TOP_RUNG) -> bool:
        """Within ``rung``'s budget: a verdict judged without rungs passes the top rung only."""
        if self.rungs:
            return bool(self.rungs.get(rung, False))
        return self.passed and rung == TOP_RUNG

    @property
    def speedup(self) -> float | None:
        if self.latency_ms and self.reference_latency_ms:
            return self.reference_latency_ms / self.latency_ms
        return None

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def _softmax64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def llm_metrics(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray]) -> dict[str, float]:
    """Per-step logits comparison; every array is ``[positions, vocab]``."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("reference and candidate must hold the same, non-zero number of samples")
    cos: list[float] = []
    top1: list[float] = []
    kl: list[float] = []
    for ref, cand in zip(reference, candidate):
        if ref.shape != cand.shape:
            raise ValueError(f"logits shapes differ: reference {ref.shape}, candidate {cand.shape}")
        r, c = ref.astype(np.float64), cand.astype(np.float64)
        denom = np.linalg.norm(r, axis=-1) * np.linalg.norm(c, axis=-1)
        cos.extend(np.where(denom > 0, (r * c).sum(-1) / np.maximum(denom, 1e-300), 1.0))
        top1.extend(r.argmax(-1) == c.argmax(-1))
        p, q = _softmax64(r), _softmax64(c)
        kl.extend((p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum(-1))
    return {
        "cosine": float(np.mean(cos)),
        "cosine_min": float(np.min(cos)),
        "top1": float(np.mean(top1)),
        "kl": float(np.mean(kl)),
        "kl_max": float(np.max(kl)),
        "steps": float(len(cos)),
    }


def perplexity_metrics(
    reference_ppl: float, candidate_ppl: float, reference_argmax: np.ndarray, candidate_argmax: np.ndarray
) -> dict[str, float]:
    """A candidate's perplexity on the held-out text against FP32's, and its greedy agreement with FP32."""
    if len(reference_argmax) != len(candidate_argmax) or not len(reference_argmax):
        raise ValueError("reference and candidate must score the same, non-zero number of tokens")
    return {
        "perplexity": candidate_ppl,
        "perplexity_fp32": reference_ppl,
        "ppl_increase_pct": 100.0 * (candidate_ppl / reference_ppl - 1.0),
        "greedy_agreement": float(np.mean(np.asarray(reference_argmax) == np.asarray(candidate_argmax))),
        "ppl_tokens": float(len(reference_argmax)),
    }


def _perplexity_reasons(metrics: dict[str, float], budget: AccuracyBudget) -> tuple[dict[str, float], list[str]]:
    limits: dict[str, float] = {}
    reasons = []
    if budget.max_ppl_increase_pct is not None:
        limits["max_ppl_increase_pct"] = budget.max_ppl_increase_pct
        if "ppl_increase_pct" not in metrics:
            reasons.append("no perplexity measured (the recipe's budget needs [perplexity])")
        elif metrics["ppl_increase_pct"] > budget.max_ppl_increase_pct:
            reasons.append(
                f"perplexity {metrics['perplexity']:.4f} is {metrics['ppl_increase_pct']:+.2f}% over FP32's "
                f"{metrics['perplexity_fp32']:.4f} (budget +{budget.max_ppl_increase_pct}%)"
            )
    if budget.min_greedy_agreement is not None:
        limits["min_greedy_agreement"] = budget.min_greedy_agreement
        if "greedy_agreement" not in metrics:
            reasons.append("no greedy agreement measured (the recipe's budget needs [perplexity])")
        elif metrics["greedy_agreement"] < budget.min_greedy_agreement:
            reasons.append(
                f"greedy agreement with FP32 {metrics['greedy_agreement']:.4f} < {budget.min_greedy_agreement}"
            )
    return limits, reasons


def asr_metrics(
    references: Sequence[str], fp32_texts: Sequence[str], candidate_texts: Sequence[str]
) -> dict[str, float]:
    from ..metrics.wer import error_rates

    words_ref, _ = error_rates(zip(references, fp32_texts))
    words_cand, chars_cand = error_rates(zip(references, candidate_texts))
    agree = float(np.mean([a == b for a, b in zip(fp32_texts, candidate_texts)])) if fp32_texts else 0.0
    return {
        "wer_fp32": words_ref.rate,
        "wer": words_cand.rate,
        "wer_delta": words_cand.rate - words_ref.rate,
        "cer": chars_cand.rate,
        "text_agreement": agree,
        "utterances": float(len(references)),
    }


def judge(
    workload: str,
    metrics: dict[str, float],
    budget: AccuracyBudget,
    precision: str,
    backend: str,
    flavour: str = "",
    rungs: Mapping[str, AccuracyBudget] | None = None,
) -> Verdict:
    """The candidate against ``budget`` (the top rung's) and each lower rung's: it passes (enters the cache)
    when within any of them; ``rungs`` says which, the reasons say what broke each budget it missed."""
    limits, reasons = _limits_and_reasons(workload, metrics, budget)
    if not rungs:
        return Verdict(precision, backend, metrics, limits, not reasons, reasons, flavour=flavour)
    within = {TOP_RUNG: not reasons}
    all_reasons = [f"{TOP_RUNG}: {r}" for r in reasons]
    for name, rung in rungs.items():
        rung_limits, rung_reasons = _limits_and_reasons(workload, metrics, rung)
        limits.update({f"{name}.{k}": v for k, v in rung_limits.items()})
        within[name] = not rung_reasons
        all_reasons += [f"{name}: {r}" for r in rung_reasons]
    return Verdict(
        precision, backend, metrics, limits, any(within.values()), all_reasons, flavour=flavour, rungs=within
    )


def _limits_and_reasons(
    workload: str, metrics: dict[str, float], budget: AccuracyBudget
) -> tuple[dict[str, float], list[str]]:
    reasons: list[str] = []
    limits: dict[str, float]
    if workload == "llm":
        limits, reasons = _perplexity_reasons(metrics, budget)
        logits = budget.logits_limits()
        limits.update(logits)
        if "min_cosine" in logits and metrics["cosine"] < budget.min_cosine:
            reasons.append(f"logits cosine {metrics['cosine']:.4f} < {budget.min_cosine}")
        if "min_top1" in logits and metrics["top1"] < budget.min_top1:
            reasons.append(f"top-1 agreement {metrics['top1']:.3f} < {budget.min_top1}")
        if "max_kl" in logits and metrics["kl"] > budget.max_kl:
            reasons.append(f"KL per step {metrics['kl']:.4f} > {budget.max_kl}")
    else:
        limits = {"max_wer_delta": budget.max_wer_delta}
        if metrics["wer_delta"] > budget.max_wer_delta:
            reasons.append(
                f"WER {metrics['wer']:.3f} is {metrics['wer_delta']:+.3f} over FP32's "
                f"{metrics['wer_fp32']:.3f} (budget +{budget.max_wer_delta})"
            )
    return limits, reasons


_QUANTIZED = ("int8", *WEIGHT_ONLY)  # int8, int8w, int4


def _cost(v: Verdict, paired: bool) -> float:
    # Paired: latency relative to the FP32 run measured interleaved with it, so load that changed
    # between builds (another job on the device) does not decide the choice.
    latency = v.latency_ms or 0.0  # choose() passes only measured verdicts
    if paired and v.reference_latency_ms:  # paired: every verdict has its reference latency
        return latency / v.reference_latency_ms
    return latency


def choose(verdicts: Sequence[Verdict], rung: str = TOP_RUNG) -> Verdict | None:
    """The engine to use on ``rung``: the fastest within its budget; a quantized one only if faster than all
    float ones within it. A lower rung takes only engines lighter than the top rung's choice (fewer weight
    bytes per token): it exists to cost less, and speeds measured in different builds on a shared machine
    can rank a heavier engine first (none lighter: None, and the top rung's choice serves)."""
    if rung != TOP_RUNG:
        top = choose(verdicts, TOP_RUNG)
        if top is not None and top.weight_bytes:
            verdicts = [v for v in verdicts if v.weight_bytes and v.weight_bytes < top.weight_bytes]
    passing = [v for v in verdicts if v.passes(rung) and v.latency_ms is not None]
    if not passing:
        return None
    paired = all(v.reference_latency_ms for v in passing)
    floats = [v for v in passing if v.precision not in _QUANTIZED]
    quantized = [v for v in passing if v.precision in _QUANTIZED]
    best_float = min(floats, key=lambda v: _cost(v, paired)) if floats else None
    fastest_q = min(quantized, key=lambda v: _cost(v, paired)) if quantized else None
    if fastest_q is not None and (best_float is None or _cost(fastest_q, paired) < _cost(best_float, paired)):
        return fastest_q
    return best_float


def render_table(verdicts: Sequence[Verdict], workload: str, chosen: Verdict | None = None) -> str:
    if workload == "llm":
        head = f"{'candidate':<26} {'cosine':>8} {'top-1':>7} {'KL/step':>9} {'ms':>9} {'speed':>6}  verdict"
    else:
        head = f"{'candidate':<26} {'WER':>7} {'ΔWER':>7} {'agree':>7} {'ms':>9} {'speed':>6}  verdict"
    lines = [head, "-" * len(head)]
    for v in verdicts:
        name = f"{v.backend}/{v.precision}" + (f" {v.flavour}" if v.flavour else "")
        m = v.metrics
        ms = f"{v.latency_ms:9.2f}" if v.latency_ms is not None else f"{'-':>9}"
        speed = f"{v.speedup:5.2f}x" if v.speedup else f"{'-':>6}"
        verdict = ("PASS" if v.passed else "REFUSED: " + "; ".join(v.reasons)) + (" ← chosen" if v is chosen else "")
        if workload == "llm":
            lines.append(f"{name:<26} {m['cosine']:8.4f} {m['top1']:7.3f} {m['kl']:9.5f} {ms} {speed}  {verdict}")
        else:
            lines.append(
                f"{name:<26} {m['wer']:7.3f} {m['wer_delta']:+7.3f} {m['text_agreement']:7.3f} {ms} {speed}  {verdict}"
            )
    return "\n".join(lines)
