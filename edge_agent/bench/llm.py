"""``edge-agent bench llm``: the agent's LLM serving path against a bare runtime loop, same run.

It measures a tier as the daemon serves it: the engine the daemon would load for that tier (a verified
cached engine, else the model folder: ``engines/resolve.py``), its backend, device and threads, and the
scheduler limits the daemon gives it (``serving.llm.tiers.tier_limits``: the tier's batch, batching timeout,
preferred sizes), all from the config (``--config``, else the installed one, else the embedded
default). The header line says which.

Each round runs the same synthetic prompts twice, alternating:
- **agent**: through ``LLMScheduler`` (continuous batching, sampling objects, detokenization,
  per-request timing), driven by ``C`` closed-loop clients or by Poisson arrivals (``--rate``);
- **baseline**: a bare sequential greedy loop, ``DecoderLM.generate_greedy`` (the runtime session with
  present→past fed back), timed with ``time.perf_counter``: what the runtime gives with nothing around it;
- **genai** (when an onnxruntime-genai folder of the model exists): its own ``og.Generator`` (``genai.py``);
- **ov-genai** (an NPU tier): openvino-genai's NPU pipeline on the same stateful IR (``ov_genai.py``);
- **scaling** (``--scaling K``): the agent again at concurrency K, so C→K ratios come from one run.

Figures are medians across rounds (noise on shared cores is about ±10%). Latency names follow
docs/metrics.md: ``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms``. ``goodput`` counts
requests whose TTFT is within ``--sla-ms`` (default 387 ms, the agent's default TTFT SLO) per second.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from ..config import LLMTierConfig, load_settings, resolve_config_path
from ..engines.cache import EngineCache
from ..engines.resolve import EngineResolver, Resolved
from ..errors import InputError
from ..metrics.timing import RequestTiming
from ..models.catalog import resolve_model
from ..models.llm import DecoderLM
from ..progress import Progress
from ..serving.llm.scheduler import Limits, LLMScheduler
from ..serving.llm.tiers import tier_limits
from . import ov_genai
from . import roofline as rl
from .genai import GenaiRunner, find_genai_folder
from .genai import summary as genai_summary
from .llm_report import (
    _median_of,
    baseline_mode,
    c1_ratios,
    format_table,
    report_notes,
    scaling_summary,
    setup_section,
    side_summary,
)
from .llm_runners import BareLoop, agent_round, peer_round, run_baseline, synthetic_prompts
from .options import LLMOptions

log = logging.getLogger(__name__)


def _validate(opts: LLMOptions) -> None:
    if opts.requests < 1:
        raise InputError(f"--requests must be at least 1, got {opts.requests}")
    if opts.concurrency < 1:
        raise InputError(f"--concurrency must be at least 1, got {opts.concurrency}")
    if opts.rate is not None and not opts.rate > 0:
        raise InputError(f"--rate must be > 0 requests/s, got {opts.rate}")
    if opts.prompt_tokens < 1:
        raise InputError(f"--prompt-tokens must be at least 1, got {opts.prompt_tokens}")
    if opts.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {opts.max_new_tokens}")
    if opts.threads is not None and opts.threads < 0:
        raise InputError(f"--threads must be >= 0 (0: the runtime's default), got {opts.threads}")
    if opts.scaling is not None and opts.scaling < 1:
        raise InputError(f"--scaling must be at least 1, got {opts.scaling}")
    if opts.rounds < 1:
        raise InputError(f"--rounds must be at least 1, got {opts.rounds}")
    if opts.sla_ms is not None and not opts.sla_ms > 0:
        raise InputError(f"--sla-ms must be > 0, got {opts.sla_ms}")


# -- the command --------------------------------------------------------------------------------


@dataclasses.dataclass
class Served:
    """What the daemon would serve for the measured tier: the tier (with any override), what its engine
    resolved to, the scheduler limits and threads, and where the settings came from."""

    tier: LLMTierConfig
    resolved: Resolved
    limits: Limits
    threads: int
    config: str
    resolver: EngineResolver

    def open(self) -> DecoderLM:
        return self.resolver.open(self.resolved, self.tier, self.threads)

    def header(self) -> str:
        r, t, lim = self.resolved, self.tier, self.limits
        what = (
            f"engine {r.engine.key[:12]} ({r.engine.manifest.get('backend')}/{r.engine.manifest.get('precision')})"
            if r.engine
            else f"model folder {r.source.path} ({r.why_plain})"
        )
        return (
            f"bench llm: tier {t.name!r} as the daemon serves it: {what}; {t.backend} on {t.device}, "
            f"threads {self.threads or 'runtime default'}; batching from {self.config}: max_batch {lim.max_batch}, "
            f"batch_timeout_ms {lim.batch_timeout_ms:g}, preferred_batch_sizes {list(lim.preferred_batch_sizes)}"
        )


def _served(opts: LLMOptions, show: bool) -> tuple[Served, float]:
    """The tier, engine, limits and threads ``edge-agent run`` would use with the same config, and the
    config's TTFT target (``sla.target_ms``)."""
    settings = load_settings(opts.config)
    path = resolve_config_path(opts.config)
    tiers = settings.models.llm
    if not tiers:
        raise InputError("the config has no [[models.llm]] tier to measure")
    tier = tiers[0] if opts.tier is None else next((t for t in tiers if t.name == opts.tier), None)
    if tier is None:
        raise InputError(f"--tier {opts.tier!r}: no such LLM tier; configured: {[t.name for t in tiers]}")
    update = {k: v for k, v in (("model", opts.model), ("backend", opts.backend)) if v is not None}
    tier = tier.model_copy(update=update)
    models_dir = Path(opts.cache_dir) if opts.cache_dir else settings.models.cache_dir
    with Progress("demo weights", "MB", enabled=show) as weights:
        resolve_model(tier.model, models_dir, progress=lambda done, total: weights.update(done / 1e6, total / 1e6))
    cache = EngineCache(settings.engines.cache_dir, settings.engines.max_bytes)
    resolver = EngineResolver(
        cache, models_dir, lambda kind, doc: log.warning("%s: %s", kind, doc), settings.engines.recipes_dir
    )
    limits = tier_limits(tier, settings.batching, settings.prefix_cache, settings.sla.target_ms)
    # The admission bounds only refuse requests (the daemon answers 429/504): a benchmark must lose none.
    limits = dataclasses.replace(
        limits, max_queue=max(limits.max_queue, opts.requests + 1), queue_timeout_ms=max(limits.queue_timeout_ms, 3.6e6)
    )
    if not opts.prefix_cache:  # the rounds repeat their prompts: a prefix cache would time hits, not prefills
        limits = dataclasses.replace(limits, prefix_cache_mb=0.0)
    threads = settings.device.threads if opts.threads is None else opts.threads
    config = str(path) if path else "the embedded default"
    return Served(tier, resolver.resolve(tier), limits, threads, config, resolver), settings.sla.target_ms


def run(opts: LLMOptions) -> int:
    """Measure the tier ``opts`` names against its peers; print the report (and write its JSON and plot)."""
    _validate(opts)
    show = not opts.quiet
    served, target_ms = _served(opts, show)
    if opts.sla_ms is None:
        opts = dataclasses.replace(opts, sla_ms=target_ms)
    lm = served.open()
    if lm.max_rows is not None and served.limits.max_batch > lm.max_rows:  # a stateful model, as the scheduler caps it
        served.limits = dataclasses.replace(served.limits, max_batch=lm.max_rows, preferred_batch_sizes=(lm.max_rows,))
    try:
        lm.check_prompt([0] * opts.prompt_tokens, opts.max_new_tokens)  # fits the model's context
        return _run_loaded(opts, served, lm, show)
    finally:
        lm.close()


@dataclasses.dataclass
class Peers:
    """The runtimes measured beside the agent other than the bare loop: onnxruntime-genai and openvino-genai's
    NPU pipeline, each None with the reason when it is not measured."""

    genai: GenaiRunner | None
    genai_folder: Path | None
    genai_reason: str | None
    ov: ov_genai.OvGenaiRunner | None
    ov_reason: str | None


def _peers(opts: LLMOptions, served: Served, lm) -> Peers:
    """Find (and open) the onnxruntime-genai folder and the openvino-genai IR of the measured model."""
    genai_folder, genai_reason = find_genai_folder(served.resolved.source, opts.genai)
    genai = GenaiRunner(genai_folder, served.threads or 2) if genai_folder else None
    ov_ir, ov_reason = ov_genai.find_ir(lm, served.resolved.ref, opts.ov_genai)
    ov = ov_genai.OvGenaiRunner(ov_ir, lm.npu_shape, lm.config.get("sliding_window")) if ov_ir else None
    return Peers(genai, genai_folder, genai_reason, ov, ov_reason)


@dataclasses.dataclass
class Measured:
    """What the rounds measured: each side's per-round summaries (``at_k``: the agent at ``--scaling`` K), the raw
    TTFT/ITL samples of each side (the plot's), the token ids the peers and the agent generated (the last round's
    for the peers), and the closed loop's ramp."""

    agent: list[dict] = dataclasses.field(default_factory=list)
    at_k: list[dict] = dataclasses.field(default_factory=list)
    baseline: list[dict] = dataclasses.field(default_factory=list)
    genai: list[dict] = dataclasses.field(default_factory=list)
    ov: list[dict] = dataclasses.field(default_factory=list)
    raw: dict[str, dict[str, list[float]]] = dataclasses.field(
        default_factory=lambda: {
            side: {"ttft_ms": [], "itl_ms": []} for side in ("agent", "baseline", "genai", "ov_genai")
        }
    )
    agent_tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    genai_tokens: list[list[int]] = dataclasses.field(default_factory=list)
    ov_tokens: list[list[int]] = dataclasses.field(default_factory=list)
    ramp_s: float = 0.0
    k_ramp_s: float = 0.0


def _measure(
    opts: LLMOptions, lm: DecoderLM, limits: Limits, prompts: list[list[int]], peers: Peers, show: bool
) -> Measured:
    """Warm every side up, then run ``--rounds`` rounds, each side in turn (agent, agent at K, baseline, genai,
    ov-genai), so slow drifts of the machine fall on all of them alike. Closes the openvino-genai pipeline."""
    m = Measured()
    sink: list[RequestTiming] = []
    # One scheduler with the daemon's limits serves every concurrency: the load changes, the daemon does not.
    scheduler = LLMScheduler(lm, limits, on_finished=sink.append).start()
    try:
        _warm_up(opts, scheduler, lm, prompts, peers, m)
        for r in range(opts.rounds):
            _round(opts, r, scheduler, sink, lm, prompts, peers, m, show)
    finally:
        scheduler.stop()
        if peers.ov:
            peers.ov.close()
    return m


def _warm_up(opts: LLMOptions, scheduler: LLMScheduler, lm: DecoderLM, prompts, peers: Peers, m: Measured) -> None:
    """One request each way, excluded from the figures; the agent's full-length one sets the closed loop's ramps
    (``m.ramp_s`` at C, ``m.k_ramp_s`` at K) unless ``--ramp-s`` gives them."""
    from ..models.sampling import SamplingParams

    C, K, T = opts.concurrency, opts.scaling, opts.max_new_tokens
    warm = scheduler.submit(prompts[0], SamplingParams(max_new_tokens=T, ignore_eos=True), tags=("warmup",))
    e2e_s = (warm.result(600).timing.e2e_ms or 0.0) / 1e3
    m.ramp_s = opts.ramp_s if opts.ramp_s is not None else (e2e_s if opts.rate is None and C > 1 else 0.0)
    m.k_ramp_s = opts.ramp_s if opts.ramp_s is not None else (e2e_s if opts.rate is None and (K or 0) > 1 else 0.0)
    if not opts.no_baseline:
        run_baseline(lm, [prompts[0][:8]], 2, [])
    if peers.genai:
        peers.genai.generate(prompts[0][:8], 2)
    if peers.ov:  # its first request costs several times a later one, as the agent's does
        peers.ov.generate(prompts[0], T)


def _round(
    opts: LLMOptions, r: int, scheduler, sink, lm: DecoderLM, prompts, peers: Peers, m: Measured, show: bool
) -> None:
    """Round ``r`` of every side, appended to ``m``."""
    C, K, raw = opts.concurrency, opts.scaling, m.raw
    label = f"agent round {r + 1}/{opts.rounds}"
    m.agent.append(agent_round(scheduler, sink, prompts, C, opts, m.ramp_s, raw["agent"], label, show, m.agent_tokens))
    if K:
        k_raw: dict[str, list[float]] = {"ttft_ms": [], "itl_ms": []}  # the C=K rounds keep no raw samples
        label = f"agent C={K} round {r + 1}/{opts.rounds}"
        m.at_k.append(agent_round(scheduler, sink, prompts, K, opts, m.k_ramp_s, k_raw, label, show))
    of = f"round {r + 1}/{opts.rounds}"
    if not opts.no_baseline:
        peer_round(BareLoop(lm), f"baseline {of}", prompts, opts, raw["baseline"], m.baseline)
    if peers.genai:
        m.genai_tokens = peer_round(peers.genai, f"onnxruntime-genai {of}", prompts, opts, raw["genai"], m.genai)
    if peers.ov:
        m.ov_tokens = peer_round(peers.ov, f"openvino-genai NPU {of}", prompts, opts, raw["ov_genai"], m.ov)


def _roofline(opts: LLMOptions, served: Served, lm: DecoderLM, agent: dict, baseline: dict | None) -> dict:
    """The memory-bandwidth roofline of the model, with the achieved decode tokens/s (the agent's, else the
    baseline's) as a fraction of its bound."""
    source, achieved = None, None
    if agent["decode_tokens_per_s"]:
        source, achieved = "agent", agent["decode_tokens_per_s"]
    elif baseline:
        source, achieved = "baseline", baseline["decode_tokens_per_s"]
    mean_context = opts.prompt_tokens + (opts.max_new_tokens - 1) / 2
    threads = served.threads or os.cpu_count() or 1
    roof = rl.of_model(served.resolved.ref.path, lm.config, lm.contract, threads, mean_context, achieved)
    roof["achieved_source"] = source
    return roof


def _genai_side(opts: LLMOptions, lm: DecoderLM, prompts, peers: Peers, m: Measured, agent: dict) -> dict | None:
    """onnxruntime-genai's medians, its greedy agreement with the bare loop and the agent/genai ratios."""
    if not m.genai:
        return None
    ours = [list(lm.generate_greedy(p, opts.max_new_tokens, stop_at_eos=False)) for p in prompts[:2]]
    return genai_summary(m.genai, m.agent, agent, peers.genai_folder, ours, m.genai_tokens[:2])


def _ov_side(opts: LLMOptions, lm: DecoderLM, prompts, peers: Peers, m: Measured) -> dict | None:
    """openvino-genai's medians and ratios to the agent, and how its greedy tokens agree with the agent's."""
    if not (peers.ov and m.ov):
        return None
    side = ov_genai.summary(_median_of(m.ov), peers.ov, m.agent, m.ov, m.raw)
    T = opts.max_new_tokens
    bare_all = [list(lm.generate_greedy(p, T, stop_at_eos=False, known_only=False)) for p in prompts]
    ours = [m.agent_tokens[i] for i in sorted(m.agent_tokens)]
    side["tokens"] = ov_genai.token_check(ours, m.ov_tokens, bare_all, lm.vocab_limit)
    return side


def _summaries(opts: LLMOptions, served: Served, lm: DecoderLM, prompts, peers: Peers, m: Measured) -> dict:
    """The measured part of the report: each side's medians, the C=1 ratios, the roofline, the peers, scaling
    and the notes (in the report's order)."""
    agent = side_summary(m.agent)
    baseline = side_summary(m.baseline, mode=baseline_mode(bool(lm.max_rows))) if m.baseline else None
    overhead, decode_ratio = c1_ratios(agent, baseline) if opts.concurrency == 1 else (None, None)
    roof = _roofline(opts, served, lm, agent, baseline)
    genai = _genai_side(opts, lm, prompts, peers, m, agent)
    if genai and genai["decode_tokens_per_s"]:  # how close each side comes to the same bound
        roof["genai_fraction"] = round(genai["decode_tokens_per_s"] / roof["bound_tokens_per_s"], 3)
    ov_side = _ov_side(opts, lm, prompts, peers, m)
    return {
        "agent": agent,
        "baseline": baseline,
        "overhead_ratio": overhead,
        "decode_ratio": decode_ratio,
        "roofline": roof,
        "genai": genai,
        "genai_reason": peers.genai_reason,
        "ov_genai": ov_side,
        "ov_genai_reason": peers.ov_reason,
        "scaling": scaling_summary(opts.scaling, m.at_k, agent),
        "notes": report_notes(opts, served.limits, served.tier.max_new_tokens, baseline, genai, ov_side),
    }


def _emit(opts: LLMOptions, report: dict, raw: dict[str, dict[str, list[float]]]) -> None:
    """Print the report (header, table, openvino-genai lines); write its JSON (``--json``) and plot (``--plot``)."""
    print(report["header"])
    print(format_table(report))
    print("\n".join(ov_genai.format_lines(report)))
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if opts.plot:
        from .plot import plot_report

        plot_report(report, raw, Path(opts.plot))


def _run_loaded(opts: LLMOptions, served: Served, lm: DecoderLM, show: bool) -> int:
    """Measure the opened model against its peers, then print and write the report."""
    prompts = synthetic_prompts(lm, opts.requests, opts.prompt_tokens)
    peers = _peers(opts, served, lm)
    m = _measure(opts, lm, served.limits, prompts, peers, show)
    report = {**setup_section(opts, served, m.ramp_s), **_summaries(opts, served, lm, prompts, peers, m)}
    _emit(opts, report, m.raw)
    return 0
