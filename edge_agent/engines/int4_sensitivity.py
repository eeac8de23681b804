"""Calibration for 4-bit weights: activation statistics, per-group sensitivity, and which groups stay 8-bit.

Everything here runs the FP32 graph on calibration text (never the gate's held-out text) in ONNX Runtime:

``activation_stats``   every weight MatMul's input over the text: ``X^T X`` (GPTQ's Hessian) and its diagonal
                       over the token count (the importance of each input: ``kquant``'s weights).
``Evaluator``          perplexity of the FP32 graph with some weights swapped for their dequantized 4-bit values
                       (the weights are inputs of one session, fed per run). This is the weight
                       error alone: activations stay float here, where the engine's accuracy_level 4 also
                       quantizes them per block; so it ranks groups, and the gate measures the real engine.
``sensitivity``        Δperplexity of quantizing one group alone to 4 bits, the rest FP32. Groups are per
                       layer (its seven matrices together) plus the LM head: a per-layer approximation of
                       per-matrix sensitivity (19 measurements instead of 127).
``keep_8bit``          the greedy choice: groups ordered by Δperplexity per byte 4 bits would save, the most
                       sensitive first; the shortest prefix kept at 8 bits whose mixed model fits the budget
                       (found by bisection over the prefix length, each step one measured perplexity).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError

Progress = Callable[[str], None]
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Site:
    """One MatMul with a constant weight: its node, weight initializer, input tensor, and group."""

    node: str
    weight: str
    input: str
    shape: tuple[int, int]
    group: str  # "layer.<i>" or "head" (or "other")


def sites(model: Any, head: str | None) -> list[Site]:
    """The weight MatMuls of ``model`` (a tied head already untied) grouped per layer and head."""
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        init = inits[node.input[1]]
        if len(init.dims) != 2:
            continue
        m = _LAYER.search(init.name) or _LAYER.search(node.name)
        group = "head" if node.name == head else (f"layer.{int(m[1]):02d}" if m else "other")
        out.append(Site(node.name, init.name, node.input[0], (int(init.dims[0]), int(init.dims[1])), group))
    return out


@dataclass(slots=True)
class Stats:
    """Per input tensor: ``hessian`` = sum of ``x x^T`` over calibration tokens, and the token count."""

    hessian: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: int = 0

    def importance(self, name: str) -> np.ndarray:
        return (np.diag(self.hessian[name]) / max(self.tokens, 1)).astype(np.float32)


def _feeds(session: Any, ids: Sequence[int], config: dict) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    n = len(ids)
    for arg in session.get_inputs():
        if arg.name == "input_ids":
            feeds[arg.name] = np.asarray([ids], np.int64)
        elif arg.name == "attention_mask":
            feeds[arg.name] = np.ones((1, n), np.int64)
        elif arg.name == "position_ids":
            feeds[arg.name] = np.arange(n, dtype=np.int64)[None]
        elif arg.name.startswith("past_key_values"):
            heads = arg.shape[1] if isinstance(arg.shape[1], int) else int(config["num_key_value_heads"])
            dim = arg.shape[3] if isinstance(arg.shape[3], int) else int(config["head_dim"])
            feeds[arg.name] = np.zeros((1, heads, 0, dim), np.float32)
    if any(a.name == "logits_to_keep" for a in session.get_overridable_initializers()):
        feeds["logits_to_keep"] = np.array(n, np.int64)
    return feeds


@dataclass(frozen=True, slots=True)
class CalibrationText:
    """The calibration text's tokens in two slices: ``fit``, what the 4-bit method fits on (activation statistics,
    GPTQ's Hessians, kquant's importance), and right after it ``score``, what the sensitivity pass scores. No
    token is in both, so the pass measures each group's error on text the method did not fit it to."""

    fit: list[int]
    score: list[int]
    bos: int | None
    fit_range: tuple[int, int]  # token positions [start, end) in the text
    score_range: tuple[int, int]
    total: int  # tokens in the whole text


def calibration_text(source: Any, text: Path, skip: int, fit_tokens: int, score_tokens: int = 0) -> CalibrationText:
    """Tokens ``skip .. skip + fit_tokens`` of the calibration ``text`` (a text file or ``{"text"}`` JSONL) by
    the tokenizer of ``source`` (a ``ModelRef``), then the next ``score_tokens`` (0: none) for the sensitivity
    pass; each slice needs 2 tokens or more, else one line naming the key."""
    from ..models.perplexity import text_tokens
    from ..models.tokenizer import Tokenizer
    from .datasets import read_text_corpus

    ids, bos = text_tokens(Tokenizer(source.path, source.model_type), read_text_corpus(Path(text)))
    fit = list(ids[skip : skip + fit_tokens])
    if len(fit) < 2:
        raise InputError(
            f"weight_only.calibration {text}: {len(ids)} tokens, none left after calibration_skip_tokens = {skip}"
        )
    start = skip + len(fit)
    score = list(ids[start : start + score_tokens]) if score_tokens else []
    if score_tokens and len(score) < 2:
        raise InputError(
            f"weight_only.sensitivity_tokens {score_tokens}: {text} has {len(ids)} tokens, {len(score)} after "
            f"calibration_skip_tokens + calibration_tokens = {start} (the sensitivity pass scores the tokens after "
            "those the method fits on)"
        )
    return CalibrationText(fit, score, bos, (skip, start), (start, start + len(score)), len(ids))


def calibration_ids(source: Any, text: Path, skip: int, count: int) -> tuple[list[int], int | None]:
    """Tokens ``skip .. skip + count`` of the calibration ``text`` and the tokenizer's BOS id (None without one)."""
    cut = calibration_text(source, text, skip, count)
    return cut.fit, cut.bos


def calibration_windows(ids: Sequence[int], bos: int | None, window: int) -> list[list[int]]:
    """The calibration text cut into windows of ``window`` tokens, BOS first in each."""
    lead = [bos] if bos is not None else []
    step = window - len(lead)
    return [[*lead, *ids[a : a + step]] for a in range(0, len(ids), step) if len(ids[a : a + step]) > 1]


def _session(model_bytes: bytes, threads: int, overrides: dict[str, np.ndarray] | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    keep = []
    for name, value in (overrides or {}).items():
        v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value, np.float32))
        keep.append(v)
        opts.add_initializer(name, v)
    session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
    return session, keep


def activation_stats(
    model: Any, windows: Iterable[Sequence[int]], config: dict, threads: int = 0, progress: Progress | None = None
) -> Stats:
    """``X^T X`` of every weight MatMul's input over ``windows`` of calibration tokens (FP32 graph)."""
    import onnx

    inputs = sorted({s.input for s in sites(model, None)})
    have = {o.name for o in model.graph.output}
    added = [n for n in inputs if n not in have]
    for name in added:  # for the one serialization, then taken out again
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    try:
        session, _ = _session(model.SerializeToString(), threads)
    finally:
        del model.graph.output[len(model.graph.output) - len(added) :]
    stats = Stats()
    windows = list(windows)
    for i, ids in enumerate(windows):
        values = session.run(inputs, _feeds(session, ids, config))
        for name, x in zip(inputs, values):
            x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
            h = x2.T @ x2
            stats.hessian[name] = stats.hessian[name] + h if name in stats.hessian else h
        stats.tokens += len(ids)
        if progress:
            progress(f"calibration activations {i + 1}/{len(windows)}")
    return stats


def _without_weights(model: Any) -> Any:
    """A copy of ``model`` without its initializers (those are added back by the caller, as it chooses)."""
    import onnx

    probe = onnx.ModelProto()
    kept = list(model.graph.initializer)
    del model.graph.initializer[:]
    try:
        probe.CopyFrom(model)
    finally:
        model.graph.initializer.extend(kept)
    return probe


def _view(init: Any) -> np.ndarray:
    """A float initializer's values without a copy (its raw bytes), else a copy."""
    from onnx import numpy_helper

    if init.raw_data and init.data_type == 1:
        return np.frombuffer(init.raw_data, dtype=np.float32).reshape(tuple(init.dims))
    return numpy_helper.to_array(init)


def _input_of(init: Any) -> Any:
    import onnx

    return onnx.helper.make_tensor_value_info(init.name, onnx.TensorProto.FLOAT, list(init.dims))


class Evaluator:
    """Perplexity of ``model`` on calibration windows with chosen weights replaced by given values.

    The weights of ``sites`` become graph inputs of one session (fed their FP32 values unless overridden), so
    each measurement is a run, not a new session."""

    def __init__(
        self, model: Any, windows: Sequence[Sequence[int]], config: dict, threads: int = 0, names: Iterable[str] = ()
    ) -> None:
        wanted = set(names)
        probe = _without_weights(model)
        self.defaults: dict[str, np.ndarray] = {}
        kept = []
        for init in model.graph.initializer:
            if init.name in wanted:  # a view of the proto's bytes, no copy
                self.defaults[init.name] = _view(init)
                probe.graph.input.append(_input_of(init))
            else:
                kept.append(init)
        probe.graph.initializer.extend(kept)
        self.session, _ = _session(probe.SerializeToString(), threads)
        del probe
        self.windows = [list(w) for w in windows]
        self.config = config

    def perplexity(self, overrides: dict[str, np.ndarray]) -> float:
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise ValueError(f"not an input of the evaluator: {sorted(unknown)[:3]}")
        weights = {**self.defaults, **{k: np.ascontiguousarray(v, np.float32) for k, v in overrides.items()}}
        nll, count = 0.0, 0
        for ids in self.windows:
            feeds = {**_feeds(self.session, ids, self.config), **weights}
            logits = self.session.run(["logits"], feeds)[0][0].astype(np.float64)
            targets = np.asarray(ids[1:])
            rows = logits[:-1]
            top = rows.max(axis=-1)
            lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=-1))
            nll += float((lse - rows[np.arange(len(targets)), targets]).sum())
            count += len(targets)
        return float(np.exp(nll / count))


def bytes_saved(site: Site, bits_from: int, bits_to: int, block_size: int) -> float:
    """Weight bytes a decode step stops reading when ``site`` goes from ``bits_from`` to ``bits_to`` bits."""
    k, n = site.shape
    return (bits_from - bits_to) / 8 * k * n


@dataclass(slots=True)
class Choice:
    """The mixed-precision decision and what it was based on (for the engine's report)."""

    budget_pct: float
    fp32_ppl: float
    all4_ppl: float
    sensitivity: dict[str, float]  # group -> Δppl % of that group alone at 4 bits
    order: list[str]
    keep_8bit: list[str]
    mixed_ppl: float
    measured: dict[int, float]  # prefix length -> Δppl %
    fits: bool

    def to_dict(self) -> dict:
        return {
            "budget_pct": self.budget_pct,
            "calibration_ppl_fp32": self.fp32_ppl,
            "calibration_ppl_all_4bit": self.all4_ppl,
            "sensitivity_pct": self.sensitivity,
            "order": self.order,
            "keep_8bit": self.keep_8bit,
            "calibration_ppl_mixed": self.mixed_ppl,
            "prefixes_measured_pct": {str(k): v for k, v in sorted(self.measured.items())},
            "fits": self.fits,
        }


def keep_8bit(
    evaluator: Evaluator,
    all_sites: Sequence[Site],
    quantized: Callable[[Site], np.ndarray],
    budget_pct: float,
    eight_bit: Callable[[Site], np.ndarray],
    progress: Progress | None = None,
) -> Choice:
    """Which groups stay 8-bit so the calibration perplexity is within ``budget_pct`` of FP32's, at the least
    bytes: ``quantized`` / ``eight_bit`` give a site's dequantized 4- / 8-bit weight (made when needed, so
    at most one mixed model's weights are in memory at once)."""
    if budget_pct < 0:
        raise InputError(f"weight_only.mixed_budget_pct {budget_pct}: must be >= 0")
    say = progress or (lambda _m: None)
    groups: dict[str, list[Site]] = {}
    for s in all_sites:
        groups.setdefault(s.group, []).append(s)
    fp32 = evaluator.perplexity({})
    say(f"sensitivity: fp32 {fp32:.3f}")

    def pct(ppl: float) -> float:
        return 100.0 * (ppl / fp32 - 1.0)

    sens: dict[str, float] = {}
    for i, (g, members) in enumerate(sorted(groups.items())):
        sens[g] = pct(evaluator.perplexity({s.weight: quantized(s) for s in members}))
        say(f"sensitivity {i + 1}/{len(groups)}: {g} {sens[g]:+.2f}%")
    saved = {g: sum(bytes_saved(s, 8, 4, 0) for s in m) for g, m in groups.items()}
    order = sorted(groups, key=lambda g: sens[g] / saved[g], reverse=True)

    def mixed(prefix: int) -> dict[str, np.ndarray]:
        keep = set(order[:prefix])
        return {s.weight: (eight_bit if s.group in keep else quantized)(s) for s in all_sites}

    measured: dict[int, float] = {}

    def at(prefix: int) -> float:
        if prefix not in measured:
            measured[prefix] = pct(evaluator.perplexity(mixed(prefix)))
            say(f"mixed: {prefix} group(s) at 8 bits {measured[prefix]:+.2f}%")
        return measured[prefix]

    lo, hi = 0, len(order)
    if at(0) <= budget_pct:
        hi = 0
    elif at(hi) > budget_pct:
        lo = hi  # even everything at 8 bits misses: report it, keep everything 8-bit
    else:
        while hi - lo > 1:  # at(lo) over budget, at(hi) within
            mid = (lo + hi) // 2
            if at(mid) <= budget_pct:
                hi = mid
            else:
                lo = mid
    best = hi
    return Choice(
        budget_pct,
        fp32,
        fp32 * (1 + measured[0] / 100),
        sens,
        order,
        order[:best],
        fp32 * (1 + measured[best] / 100),
        measured,
        measured[best] <= budget_pct,
    )


_ROLE = re.compile(r"(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|down_proj)")


def site_key(site: Site) -> str:
    """A site's name across graphs of one model (the plain export, its in-place KV form): ``head`` for the
    LM head, else its layer and projection (``layer.03/q_proj``) where the names say, else its weight's name."""
    if site.group == "head":
        return "head"
    role = _ROLE.search(site.node) or _ROLE.search(site.weight)
    return f"{site.group}/{role[1]}" if role and site.group.startswith("layer.") else site.weight


@dataclass(slots=True)
class Calibration:
    """What the calibration text gave: per site key, the Hessian of its input; the windows; the FP32 graph."""

    stats: Stats
    inputs: dict[str, str]  # site key -> its input tensor in the calibration graph
    windows: list[list[int]]

    def importance(self, key: str) -> np.ndarray | None:
        name = self.inputs.get(key)
        return self.stats.importance(name) if name in self.stats.hessian else None

    def hessian(self, key: str) -> np.ndarray | None:
        name = self.inputs.get(key)
        return self.stats.hessian.get(name) if name else None


def calibrate(
    model: Any,
    head: str | None,
    ids: Sequence[int],
    bos: int | None,
    config: dict,
    window: int = 512,
    threads: int = 0,
    progress: Progress | None = None,
) -> Calibration:
    """Activation statistics of ``model`` (the FP32 plain export, head untied) over calibration ``ids``."""
    if len(ids) < 2:
        raise InputError("weight_only.calibration: the calibration text has fewer than 2 tokens")
    windows = calibration_windows(ids, bos, window)
    stats = activation_stats(model, windows, config, threads, progress)
    return Calibration(stats, {site_key(s): s.input for s in sites(model, head)}, windows)
