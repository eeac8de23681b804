"""``edge-agent bench llm``: the agent's LLM serving path against a bare runtime loop, same run.

Each round runs the same synthetic prompts twice, alternating:
- **agent**: through ``LLMScheduler`` (continuous batching, sampling objects, detokenization,
  per-request timing), driven by ``C`` closed-loop clients or by Poisson arrivals (``--rate``);
- **baseline**: a bare sequential greedy loop, ``DecoderLM.generate_greedy`` (the runtime session with
  present→past fed back), timed with ``time.perf_counter``: what the runtime gives with nothing around it;
- **genai** (when an onnxruntime-genai folder of the model exists): its own ``og.Generator`` (``genai.py``);
- **scaling** (``--scaling K``): the agent again at concurrency K, so C→K ratios come from one run.

Figures are medians across rounds (noise on shared cores is about ±10%). Latency names follow
docs/metrics.md: ``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms``. ``goodput`` counts
requests whose TTFT is within ``--sla-ms`` (default 387 ms, the agent's default TTFT SLO) per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..backends import SessionOptions
from ..errors import InputError
from ..metrics.timing import RequestTiming
from ..models.catalog import resolve_model
from ..models.llm import DecoderLM
from ..progress import Progress
from ..serving.llm.scheduler import Limits, LLMScheduler
from . import roofline as rl
from .genai import GenaiRunner, agreement, find_genai_folder
from .llm_report import _median_of, _ratio, format_table, summarize

SEED = 1234
DEFAULT_SLA_MS = 387.0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "llm",
        help="benchmark LLM serving: agent vs a bare runtime loop, with a bandwidth roofline",
        description="Run synthetic requests through the agent's scheduler and through a bare sequential "
        "runtime loop (alternating rounds), report TTFT/ITL/TPOT/E2E percentiles, tokens/s, "
        "goodput, overhead ratios and the memory-bandwidth roofline.",
    )
    p.add_argument(
        "--model", default="demo-phi3-small", help="demo model name or model folder (default demo-phi3-small)"
    )
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "openvino"))
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2; always set explicitly)")
    p.add_argument(
        "--concurrency", type=int, default=1, metavar="C", help="closed-loop clients / max batch (default 1)"
    )
    p.add_argument("--requests", type=int, default=16, metavar="N", help="requests per round (default 16)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="R",
        help="Poisson arrivals at R requests/s (seeded); default: closed loop with C clients",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="P", help="synthetic prompt length (default 128)")
    p.add_argument(
        "--max-new-tokens", type=int, default=128, metavar="T", help="tokens per request, EOS ignored (default 128)"
    )
    p.add_argument(
        "--sla-ms",
        type=float,
        default=DEFAULT_SLA_MS,
        help=f"goodput counts requests with ttft_ms <= this (default {DEFAULT_SLA_MS:g})",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating agent/baseline rounds; medians reported (default 3)"
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw TTFT/ITL distributions and tokens/s to PNG")
    p.add_argument("--no-baseline", action="store_true", help="skip the bare-loop baseline")
    p.add_argument(
        "--genai",
        metavar="DIR",
        default=None,
        help="onnxruntime-genai folder of the same model to compare with (default: MODEL-genai next to "
        "the model if present; 'none' to skip)",
    )
    p.add_argument(
        "--ramp-s",
        type=float,
        default=None,
        metavar="S",
        help="closed loop: client k starts at k·S/C (default: one measured request's e2e when C > 1, "
        "so clients do not arrive in lockstep; 0 = all at once)",
    )
    p.add_argument(
        "--scaling",
        type=int,
        default=None,
        metavar="K",
        help="also run concurrency K in the same rounds and report K's tokens/s and TTFT P99 as ratios "
        "to C's (e.g. --concurrency 1 --scaling 4)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: the configured models cache)")
    p.add_argument("--config", metavar="FILE", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)
    return p


# -- validation and inputs --------------------------------------------------------------------


def _validate(args: argparse.Namespace) -> None:
    if args.requests < 1:
        raise InputError(f"--requests must be at least 1, got {args.requests}")
    if args.concurrency < 1:
        raise InputError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.rate is not None and not args.rate > 0:
        raise InputError(f"--rate must be > 0 requests/s, got {args.rate}")
    if args.prompt_tokens < 1:
        raise InputError(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.threads < 1:
        raise InputError(f"--threads must be at least 1, got {args.threads}")
    if args.scaling is not None and args.scaling < 1:
        raise InputError(f"--scaling must be at least 1, got {args.scaling}")
    if args.rounds < 1:
        raise InputError(f"--rounds must be at least 1, got {args.rounds}")
    if not args.sla_ms > 0:
        raise InputError(f"--sla-ms must be > 0, got {args.sla_ms}")


def synthetic_prompts(lm, n: int, length: int, seed: int = SEED) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` ids from the tokenizer's normal (non-added, non-special) vocab."""
    tok = lm.tokenizer
    inner = getattr(tok, "_tok", None)
    high = inner.get_vocab_size(with_added_tokens=False) if inner is not None else tok.vocab_size
    high = min(high, int(lm.config.get("vocab_size") or high))
    special = set(lm.contract.eos_ids) | ({lm.contract.bos_id} if lm.contract.bos_id is not None else set())
    low = 3 if high > 3 else 0  # skip <unk>/<s>/</s>-style ids at the bottom of BPE vocabularies
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        ids = rng.integers(low, high, size=length)
        for j, v in enumerate(ids):
            while int(v) in special:
                v = rng.integers(low, high)
            ids[j] = v
        prompts.append([int(v) for v in ids])
    return prompts


def poisson_offsets(n: int, rate: float, seed: int = SEED) -> list[float]:
    """Arrival times (s from the start) of ``n`` Poisson arrivals at ``rate``/s; the first at 0."""
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return list(np.cumsum(gaps))


# -- one round of each side -------------------------------------------------------------------


def run_agent(
    scheduler,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    rate: float | None,
    max_new_tokens: int,
    sink: list,
    progress: Progress | None = None,
    ramp_s: float = 0.0,
) -> float:
    """Run every prompt through the scheduler; timings land in ``sink`` (via on_finished). Returns wall s."""
    from ..models.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    done = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def finished_one() -> None:
        with lock:
            done[0] += 1
            if progress is not None:
                progress.update(done[0], len(prompts))

    start = time.perf_counter()
    if rate is None:
        next_index = [0]

        def client(k: int) -> None:
            time.sleep(k * ramp_s / concurrency)
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(prompts):
                    return
                try:
                    scheduler.submit(prompts[i], params).result(600)
                except BaseException as exc:  # surfaced after the join
                    errors.append(exc)
                    return
                finished_one()

        workers = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        handles = []
        for offset, prompt in zip(poisson_offsets(len(prompts), rate), prompts):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            handles.append(scheduler.submit(prompt, params))
        for h in handles:
            try:
                h.result(600)
            except BaseException as exc:
                errors.append(exc)
            finished_one()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall


def run_baseline(
    lm, prompts: Sequence[Sequence[int]], max_new_tokens: int, sink: list, progress: Progress | None = None
) -> float:
    """The bare loop (``DecoderLM.generate_greedy``: prefill, argmax, present→past), one request at a time."""
    start = time.perf_counter()
    for k, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        # generate_greedy yields each token as soon as its argmax exists: the plain runtime loop.
        times = [time.perf_counter() for _ in lm.generate_greedy(prompt, max_new_tokens, stop_at_eos=False)]
        sink.append(RequestTiming(t0, t0, tuple(times), times[-1], len(prompt)))
        if progress is not None:
            progress.update(k + 1, len(prompts))
    return time.perf_counter() - start


# -- the command --------------------------------------------------------------------------------


def _cache_dir(args: argparse.Namespace) -> Path:
    if getattr(args, "cache_dir", None):
        return Path(args.cache_dir)
    from ..config import load_settings

    return load_settings(getattr(args, "config", None)).models.cache_dir


def run(args: argparse.Namespace) -> int:
    _validate(args)
    quiet = getattr(args, "quiet", False)
    show = not quiet
    with Progress("demo weights", "MB", enabled=show) as weights_progress:
        ref = resolve_model(
            args.model, _cache_dir(args), progress=lambda done, total: weights_progress.update(done / 1e6, total / 1e6)
        )
    lm = DecoderLM.open(ref, args.backend, SessionOptions(device="cpu", threads=args.threads))
    try:
        lm.check_prompt([0] * args.prompt_tokens, args.max_new_tokens)  # fits the model's context
        return _run_loaded(args, ref, lm, show)
    finally:
        lm.close()


def _run_loaded(args, ref, lm, show: bool) -> int:
    from ..models.sampling import SamplingParams

    C, N, T = args.concurrency, args.requests, args.max_new_tokens
    limits = _limits(C, args.rate, N)
    prompts = synthetic_prompts(lm, N, args.prompt_tokens)
    sink: list[RequestTiming] = []
    scheduler = LLMScheduler(lm, limits, on_finished=sink.append).start()
    agent_rounds: list[dict] = []
    K = args.scaling
    k_sink: list[RequestTiming] = []
    k_scheduler = LLMScheduler(lm, _limits(K, args.rate, N), on_finished=k_sink.append).start() if K else None
    k_rounds: list[dict] = []
    base_rounds: list[dict] = []
    genai_rounds: list[dict] = []
    raw: dict[str, dict[str, list[float]]] = {
        side: {"ttft_ms": [], "itl_ms": []} for side in ("agent", "baseline", "genai")
    }
    genai_folder, genai_reason = find_genai_folder(ref, args.genai)
    genai_runner = GenaiRunner(genai_folder, args.threads) if genai_folder else None
    genai_tokens: list[list[int]] = []
    try:
        # 1. warm-up: one request each way, excluded; the agent's full-length one sizes the ramp.
        warm = scheduler.submit(prompts[0], SamplingParams(max_new_tokens=T, ignore_eos=True), tags=("warmup",))
        e2e_s = (warm.result(600).timing.e2e_ms or 0.0) / 1e3
        ramp_s = args.ramp_s if args.ramp_s is not None else (e2e_s if args.rate is None and C > 1 else 0.0)
        k_ramp_s = args.ramp_s if args.ramp_s is not None else (e2e_s if args.rate is None and (K or 0) > 1 else 0.0)
        if k_scheduler:
            k_scheduler.submit(
                prompts[0][:8], SamplingParams(max_new_tokens=2, ignore_eos=True), tags=("warmup",)
            ).result(600)
        if not args.no_baseline:
            run_baseline(lm, [prompts[0][:8]], 2, [])
        if genai_runner:
            genai_runner.generate(prompts[0][:8], 2)
        sink.clear()
        for r in range(args.rounds):
            agent_rounds.append(
                _agent_round(
                    scheduler, sink, prompts, C, args, ramp_s, raw["agent"], f"agent round {r + 1}/{args.rounds}", show
                )
            )
            if k_scheduler:
                k_raw: dict[str, list[float]] = {"ttft_ms": [], "itl_ms": []}  # the C=K rounds keep no raw samples
                k_rounds.append(
                    _agent_round(
                        k_scheduler,
                        k_sink,
                        prompts,
                        K,
                        args,
                        k_ramp_s,
                        k_raw,
                        f"agent C={K} round {r + 1}/{args.rounds}",
                        show,
                    )
                )
            if not args.no_baseline:
                base: list[RequestTiming] = []
                with Progress(f"baseline round {r + 1}/{args.rounds}", "req", enabled=show) as prog:
                    wall = run_baseline(lm, prompts, T, base, prog)
                _collect(raw["baseline"], base)
                base_rounds.append(summarize(base, wall, args.sla_ms, batch1=True))
            if genai_runner:
                gen: list[RequestTiming] = []
                with Progress(f"onnxruntime-genai round {r + 1}/{args.rounds}", "req", enabled=show) as prog:
                    wall, genai_tokens = genai_runner.run(prompts, T, gen, prog)
                _collect(raw["genai"], gen)
                genai_rounds.append(summarize(gen, wall, args.sla_ms, batch1=True))
    finally:
        scheduler.stop()
        if k_scheduler:
            k_scheduler.stop()

    agent = _median_of(agent_rounds)
    agent["per_round_tokens_per_s"] = [r["tokens_per_s"] for r in agent_rounds]
    baseline = None
    if base_rounds:
        baseline = _median_of(base_rounds)
        baseline["per_round_tokens_per_s"] = [r["tokens_per_s"] for r in base_rounds]
        baseline["mode"] = "sequential, one request at a time, bare DecoderLM.generate_greedy loop"

    notes = []
    overhead = decode_ratio = None
    if baseline is not None:
        if C == 1:
            overhead = _ratio(agent["ttft_ms"]["p50"], baseline["ttft_ms"]["p50"])
            decode_ratio = _ratio(agent["decode_tokens_per_s"], baseline["decode_tokens_per_s"])
            if args.rate is not None:
                notes.append(
                    "open loop (Poisson): agent TTFT includes queueing behind earlier requests, "
                    "so overhead_ratio mixes load with agent overhead"
                )
        else:
            notes.append(
                "overhead_ratio and decode_ratio are defined at concurrency 1 only "
                "(the baseline runs one request at a time)"
            )

    achieved = (
        agent["decode_tokens_per_s"]
        if agent["decode_tokens_per_s"]
        else (baseline["decode_tokens_per_s"] if baseline else None)
    )
    achieved_source = "agent" if agent["decode_tokens_per_s"] else ("baseline" if baseline else None)
    c = lm.contract
    itemsize = {"float16": 2, "bfloat16": 2}.get(str(lm.config.get("torch_dtype")), 4)
    read_weights = rl.weight_bytes(ref.path) - rl.embedding_gather_bytes(lm.config, itemsize)
    roof = rl.roofline(
        rl.measure_read_bandwidth_gb_s(args.threads),
        read_weights,
        rl.kv_bytes_per_token_of_context(c.num_layers, c.num_kv_heads, c.head_dim, c.kv_dtype),
        args.prompt_tokens + (T - 1) / 2,
        achieved,
    )
    roof["achieved_source"] = achieved_source
    scaling = None
    if k_rounds:
        at_k = _median_of(k_rounds)
        scaling = {
            "concurrency": K,
            "agent": at_k,
            "tokens_per_s_ratio": _ratio(at_k["tokens_per_s"], agent["tokens_per_s"]),
            "ttft_p50_ratio": _ratio(at_k["ttft_ms"]["p50"], agent["ttft_ms"]["p50"]),
            "ttft_p99_ratio": _ratio(at_k["ttft_ms"]["p99"], agent["ttft_ms"]["p99"]),
        }
    genai = None
    if genai_rounds:
        genai = _median_of(genai_rounds)
        genai["folder"] = str(genai_folder)
        genai["mode"] = "sequential, one request at a time, og.Generator (greedy, EOS suppressed)"
        ours = [list(lm.generate_greedy(p, T, stop_at_eos=False)) for p in prompts[:2]]
        genai["token_agreement"] = agreement(ours, genai_tokens[:2])
        genai["agent_over_genai"] = {
            "ttft_p50": _ratio(agent["ttft_ms"]["p50"], genai["ttft_ms"]["p50"]),
            "tokens_per_s": _ratio(agent["tokens_per_s"], genai["tokens_per_s"]),
            "decode_tokens_per_s": _ratio(agent["decode_tokens_per_s"], genai["decode_tokens_per_s"]),
        }
        if C > 1:
            notes.append("genai runs one request at a time (like the baseline): compare its ratios at C=1")

    report = {
        "model": ref.name,
        "backend": args.backend,
        "threads": args.threads,
        "concurrency": C,
        "requests": N,
        "rate": args.rate,
        "arrivals": "poisson" if args.rate is not None else "closed-loop",
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": T,
        "sla_ms": args.sla_ms,
        "rounds": {"count": args.rounds, "aggregation": "median across rounds, agent, baseline and genai alternating"},
        "ramp_s": ramp_s,
        "limits": {"max_batch": limits.max_batch, "batch_timeout_ms": limits.batch_timeout_ms},
        "agent": agent,
        "baseline": baseline,
        "overhead_ratio": overhead,
        "decode_ratio": decode_ratio,
        "roofline": roof,
        "genai": genai,
        "genai_reason": genai_reason,
        "scaling": scaling,
        "notes": notes,
    }
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from .plot import plot_report

        plot_report(report, raw, Path(args.plot))
    return 0


def _limits(concurrency: int, rate: float | None, requests: int) -> Limits:
    max_batch = max(concurrency, 1)
    return Limits(
        max_batch=max_batch,
        batch_timeout_ms=0.0 if rate is None and concurrency == 1 else 80.0,
        preferred_batch_sizes=tuple(s for s in (2, 4) if s <= max_batch),
        max_queue=max(64, requests + 1),
        queue_timeout_ms=3_600_000.0,
    )


def _agent_round(
    scheduler, sink: list, prompts, concurrency: int, args, ramp_s: float, raw: dict, label: str, show: bool
) -> dict:
    sink.clear()
    with Progress(label, "req", enabled=show) as prog:
        wall = run_agent(scheduler, prompts, concurrency, args.rate, args.max_new_tokens, sink, prog, ramp_s)
    deadline = time.monotonic() + 5
    while len(sink) < len(prompts) and time.monotonic() < deadline:  # on_finished runs after the handle resolves
        time.sleep(0.001)
    timings = [t for t in sink if "warmup" not in t.tags]
    _collect(raw, timings)
    return summarize(timings, wall, args.sla_ms, batch1=concurrency == 1)


def _collect(into: dict, timings: Sequence[RequestTiming]) -> None:
    for t in timings:
        if t.ttft_ms is not None:
            into["ttft_ms"].append(t.ttft_ms)
        into["itl_ms"].extend(t.itl_ms)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edge-agent bench")
    add_parser(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
