"""The load runners of ``edge-agent bench llm``: synthetic prompts, the agent's scheduler driven by
closed-loop clients or Poisson arrivals, and the bare sequential runtime loop it is compared with
(the command, what it loads and its report are in ``llm.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from ..metrics.timing import RequestTiming
from ..progress import Progress
from .llm_report import summarize
from .options import LLMOptions

SEED = 1234


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
    outputs: dict[int, list[int]] | None = None,
) -> float:
    """Run every prompt through the scheduler; timings land in ``sink`` (via on_finished), each request's
    token ids in ``outputs`` (by prompt index) when given. Returns wall s."""
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
                    done_ids = scheduler.submit(prompts[i], params).result(600).token_ids
                except BaseException as exc:  # surfaced after the join
                    errors.append(exc)
                    return
                if outputs is not None:
                    outputs[i] = list(done_ids)
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
        for i, h in enumerate(handles):
            try:
                ids = h.result(600).token_ids
                if outputs is not None:
                    outputs[i] = list(ids)
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
    """The bare loop (``DecoderLM.generate_greedy``: prefill, argmax, present→past; for a stateful model the
    same through its one-sequence KV state), one request at a time."""
    start = time.perf_counter()
    for k, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        # generate_greedy yields each token as soon as its argmax exists: the plain runtime loop.
        times = [time.perf_counter() for _ in lm.generate_greedy(prompt, max_new_tokens, stop_at_eos=False)]
        sink.append(RequestTiming(t0, t0, tuple(times), times[-1], len(prompt)))
        if progress is not None:
            progress.update(k + 1, len(prompts))
    return time.perf_counter() - start


class BareLoop:
    """``run_baseline`` as a peer engine of ``peer_round``."""

    def __init__(self, lm) -> None:
        self.lm = lm

    def run(self, prompts, max_new_tokens: int, sink: list, progress: Progress | None = None) -> tuple[float, list]:
        return run_baseline(self.lm, prompts, max_new_tokens, sink, progress), []


def _sla_ms(opts: LLMOptions) -> float:
    if opts.sla_ms is None:  # ``llm.run`` fills it in from the config before any round
        raise ValueError("bench llm rounds need sla_ms")
    return opts.sla_ms


def agent_round(
    scheduler,
    sink: list,
    prompts,
    concurrency: int,
    opts: LLMOptions,
    ramp_s: float,
    raw: dict,
    label: str,
    show: bool,
    outputs: dict[int, list[int]] | None = None,
) -> dict:
    sink.clear()
    with Progress(label, "req", enabled=show) as prog:
        wall = run_agent(scheduler, prompts, concurrency, opts.rate, opts.max_new_tokens, sink, prog, ramp_s, outputs)
    deadline = time.monotonic() + 5
    while len(sink) < len(prompts) and time.monotonic() < deadline:  # on_finished runs after the handle resolves
        time.sleep(0.001)
    timings = [t for t in sink if "warmup" not in t.tags]
    collect(raw, timings)
    return summarize(timings, wall, _sla_ms(opts), batch1=concurrency == 1)


def peer_round(runner, label: str, prompts, opts: LLMOptions, raw: dict, rounds: list[dict]) -> list[list[int]]:
    """One round of a peer engine (``runner.run``: one request at a time): its summary appended to ``rounds``,
    its samples to ``raw``; returns each request's token ids."""
    timings: list[RequestTiming] = []
    with Progress(label, "req", enabled=not opts.quiet) as prog:
        wall, tokens = runner.run(prompts, opts.max_new_tokens, timings, prog)
    collect(raw, timings)
    rounds.append(summarize(timings, wall, _sla_ms(opts), batch1=True))
    return tokens


def collect(into: dict, timings: Sequence[RequestTiming]) -> None:
    for t in timings:
        if t.ttft_ms is not None:
            into["ttft_ms"].append(t.ttft_ms)
        into["itl_ms"].extend(t.itl_ms)
