"""One peer engine's measurement for scripts/bench-peers: onnxruntime-genai, OpenVINO GenAI or llama.cpp.

Runs in whichever environment has the engine (.venv for onnxruntime-genai, .venv-peers for the others)
and needs only numpy and that engine. It loads the model once, runs one unmeasured warm-up request (its
e2e sizes the client ramp), then the given prompts (token ids, the same for every engine) with greedy
decoding and EOS ignored, so every request makes exactly ``--max-new-tokens`` tokens. Each token's time is
taken when the engine hands it to the caller. ``--concurrency 1`` runs the requests one after another;
``--concurrency C`` runs C closed-loop clients, client k starting at k·ramp/C (ramp = the warm-up's e2e,
as ``edge-agent bench llm`` does), each sending its next request when its previous one ends.

Writes JSON: ``{"requests": [{"t0", "ttft_ms", "token_times"}], "wall_s", "tokens", "engine", "note"}``.

    python scripts/bench_peers_worker.py ENGINE MODEL --prompts P.json --concurrency C --max-new-tokens T --out R.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

Tokens = list[float]  # perf_counter time of each generated token


class OrtGenai:
    """onnxruntime-genai: one og.Model; one og.Generator per request (concurrent clients: one thread each)."""

    note = "C>1: one og.Generator per client thread (no continuous batching in onnxruntime-genai)"

    def __init__(self, folder: str, threads: int, max_len: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(folder)
        opts = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
        self.model = og.Model(config)

    def generate(self, prompt: Sequence[int], n: int) -> Tokens:
        og = self.og
        params = og.GeneratorParams(self.model)
        total = len(prompt) + n
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        gen = og.Generator(self.model, params)
        gen.append_tokens([int(t) for t in prompt])
        times: Tokens = []
        while not gen.is_done() and len(times) < n:
            gen.generate_next_token()
            gen.get_next_tokens()
            times.append(time.perf_counter())
        return times

    def concurrent(self, prompts, n, clients, ramp_s) -> list[tuple[float, Tokens]]:
        return threaded_clients(self.generate, prompts, n, clients, ramp_s)


class OvGenai:
    """OpenVINO GenAI: LLMPipeline for one request at a time, ContinuousBatchingPipeline for C > 1."""

    note = "C>1: ContinuousBatchingPipeline (max_num_seqs = C), stepped by the caller"

    def __init__(self, folder: str, threads: int, max_len: int) -> None:
        import openvino as ov
        import openvino_genai as ovg

        self.ov, self.ovg, self.folder, self.max_len = ov, ovg, folder, max_len
        # f32 compute and KV cache: the same numerics as the other engines (OpenVINO's CPU default may be
        # bf16 compute and a u8 KV cache, depending on the CPU).
        self.props = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        self.pipe = None
        self.cb = None

    def config(self, n: int):
        cfg = self.ovg.GenerationConfig()
        cfg.max_new_tokens = n
        cfg.min_new_tokens = n
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def ids(self, prompt: Sequence[int]):
        import numpy as np

        return self.ov.Tensor(np.array([prompt], dtype=np.int64))

    def generate(self, prompt: Sequence[int], n: int) -> Tokens:
        ovg = self.ovg
        if self.pipe is None:
            self.pipe = ovg.LLMPipeline(self.folder, "CPU", **self.props)
        times: Tokens = []

        class Stamp(ovg.StreamerBase):
            def write(self, token):
                now = time.perf_counter()
                times.extend([now] * (len(token) if isinstance(token, list) else 1))
                return ovg.StreamingStatus.RUNNING

            def end(self):
                pass

        import numpy as np

        inputs = ovg.TokenizedInputs(self.ids(prompt), self.ov.Tensor(np.ones((1, len(prompt)), dtype=np.int64)))
        self.pipe.generate(inputs, self.config(n), Stamp())
        return times

    def concurrent(self, prompts, n, clients, ramp_s) -> list[tuple[float, Tokens]]:
        ovg = self.ovg
        if self.cb is None:
            sched = ovg.SchedulerConfig()
            sched.max_num_seqs = clients
            sched.cache_size = 2
            self.cb = ovg.ContinuousBatchingPipeline(self.folder, sched, "CPU", self.props)
        pipe, cfg = self.cb, self.config(n)
        queue = list(enumerate(prompts))
        start = time.perf_counter()
        next_start = [start + k * ramp_s / clients for k in range(clients)]
        active: dict[int, tuple[object, float, Tokens]] = {}  # client -> (handle, t0, token times)
        done: list[tuple[float, Tokens]] = []
        rid = 0
        while queue or active:
            now = time.perf_counter()
            for c in range(clients):
                if c not in active and queue and now >= next_start[c]:
                    _, prompt = queue.pop(0)
                    active[c] = (pipe.add_request(rid, self.ids(prompt), cfg), time.perf_counter(), [])
                    rid += 1
            if not active:
                time.sleep(max(0.0, min(next_start) - now))
                continue
            pipe.step()
            now = time.perf_counter()
            for c, (handle, t0, times) in list(active.items()):
                if handle.can_read():
                    for out in handle.read().values():
                        times.extend([now] * len(out.generated_ids))
                if handle.get_status() != ovg.GenerationStatus.RUNNING and not handle.can_read():
                    done.append((t0, times))
                    del active[c]
                    next_start[c] = now
        return done


class LlamaCpp:
    """llama.cpp through llama-cpp-python's ``Llama.generate`` (one sequence; greedy via top_k = 1)."""

    note = "n/a: one sequence per Llama"  # llama.cpp batches sequences in llama-server, not in this package

    def __init__(self, path: str, threads: int, max_len: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=max_len + 16, n_batch=512, verbose=False
        )

    def generate(self, prompt: Sequence[int], n: int) -> Tokens:
        self.llm.reset()
        times: Tokens = []
        for _ in self.llm.generate([int(t) for t in prompt], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            if len(times) >= n:
                break
        return times

    concurrent = None


ENGINES: dict[str, type] = {"ortgenai": OrtGenai, "ovgenai": OvGenai, "llamacpp": LlamaCpp}
PACKAGES = {"ortgenai": "onnxruntime_genai", "ovgenai": "openvino_genai", "llamacpp": "llama_cpp"}


def threaded_clients(
    generate: Callable[[Sequence[int], int], Tokens], prompts, n: int, clients: int, ramp_s: float
) -> list[tuple[float, Tokens]]:
    """C closed-loop client threads over a shared queue of prompts; client k starts at k·ramp/C."""
    queue = list(prompts)
    lock = threading.Lock()
    done: list[tuple[float, Tokens]] = []
    start = time.perf_counter()

    def client(k: int) -> None:
        time.sleep(max(0.0, start + k * ramp_s / clients - time.perf_counter()))
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop(0)
            t0 = time.perf_counter()
            times = generate(prompt, n)
            with lock:
                done.append((t0, times))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("model", help="genai folder, OpenVINO IR folder or .gguf file")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON: {'warmup': [...], 'prompts': [[...]]}")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.prompts.read_text())
    prompts, n, clients = spec["prompts"], args.max_new_tokens, args.concurrency
    max_len = max(map(len, [*prompts, spec["warmup"]])) + n
    engine = ENGINES[args.engine](args.model, args.threads, max_len)
    if clients > 1 and engine.concurrent is None:
        args.out.write_text(json.dumps({"engine": args.engine, "skipped": engine.note}))
        return 0
    t0 = time.perf_counter()
    warm = engine.generate(spec["warmup"], n)
    if len(warm) != n:
        sys.exit(f"{args.engine}: the warm-up made {len(warm)} tokens, expected {n}")
    ramp_s = warm[-1] - t0
    start = time.perf_counter()
    if clients == 1:
        results = []
        for prompt in prompts:
            r0 = time.perf_counter()
            results.append((r0, engine.generate(prompt, n)))
    else:
        results = engine.concurrent(prompts, n, clients, ramp_s)
    wall = time.perf_counter() - start
    bad = [len(times) for _, times in results if len(times) != n]
    if bad:
        sys.exit(f"{args.engine}: requests made {bad} tokens, expected {n}")
    report = {
        "engine": args.engine,
        "concurrency": clients,
        "note": engine.note,
        "version": getattr(sys.modules.get(PACKAGES[args.engine]), "__version__", None),
        "ramp_s": ramp_s if clients > 1 else 0.0,
        "wall_s": wall,
        "tokens": sum(len(t) for _, t in results),
        "requests": [
            {"ttft_ms": (times[0] - r0) * 1000, "itl_ms": [(b - a) * 1000 for a, b in itertools.pairwise(times)]}
            for r0, times in results
        ],
    }
    args.out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
