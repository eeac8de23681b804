"""One engine's figures for scripts/bench-gguf-peers, measured in a process of its own (so peak RSS is its own).

Engines:
- ``llamacpp FILE.gguf``: llama.cpp through llama-cpp-python (run with .venv-llamacpp's python). One
  sequence: ``Llama.generate`` greedy (top_k 1). Four at once: llama.cpp's own batched decoding (what
  llama-server's slots do: one ``llama_decode`` per step over every sequence's next token, one unified KV
  cache), the four prompts prefilled in one batch.
- ``agent FOLDER``: edge-agent's serving path (``DecoderLM`` + ``LLMScheduler``: continuous batching,
  max batch 4) on a model or engine folder (run with .venv's python), its files read through the engine
  cache's verification first, as the daemon does before it serves an engine (which also leaves the page
  cache as the daemon's load finds it: see ``engines.cache.sha256_file``).

Every request decodes exactly ``--new-tokens`` tokens greedily (EOS ignored). Figures: TTFT and prefill
tok/s at each prompt length, batch-1 decode tok/s, aggregate tok/s with 4 requests at once, peak RSS
(VmHWM), and with ``--perplexity N`` the perplexity of the held-out text's first N tokens (windows of
1,024, stride 512, BOS first in each window, each token scored once).

    python scripts/bench_gguf_worker.py ENGINE MODEL --prompts P.json --threads 2 --out R.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=-1))
    return float(-(z[np.arange(len(targets)), targets] - lse).sum())


def windows(ids: list[int], window: int = 1024, stride: int = 512):
    """(begin, end, new): each window and how many of its last tokens no earlier window scored."""
    prev = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        yield begin, end, end - prev
        prev = end
        if end == len(ids):
            return


class LlamaCpp:
    def __init__(self, path: str, threads: int, n_ctx: int, logits_all: bool = False) -> None:
        from llama_cpp import Llama

        self.threads, self.n_ctx = threads, n_ctx
        self.llm = Llama(
            model_path=path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=1024,
            n_ubatch=512,
            logits_all=logits_all,
            verbose=False,
        )

    def one(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        self.llm.reset()
        t0 = time.perf_counter()
        times = []
        for _ in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) >= n:
                break
        return t0, times

    def four(self, prompts: list[list[int]], n: int) -> float:
        """Wall time for len(prompts) sequences decoded together, n tokens each."""
        import llama_cpp as L

        llm = self.llm
        # a context of its own with one slot per sequence and one unified KV cache (llama-server -np 4 -kvu)
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = self.n_ctx, 1024, 512
        params.n_seq_max, params.kv_unified = len(prompts), True
        params.n_threads = params.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(llm.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not make a 4-sequence context")
        batch = L.llama_batch_init(sum(map(len, prompts)) + len(prompts), 0, len(prompts))
        vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(llm.model))
        try:
            t0 = time.perf_counter()

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
                batch.n_tokens += 1

            last = []
            for s, p in enumerate(prompts):
                for j, t in enumerate(p):
                    add(t, j, s, j == len(p) - 1)
                last.append(batch.n_tokens - 1)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed on the prompts")
            pos = [len(p) for p in prompts]
            for _ in range(n):
                picks = [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (vocab,)).argmax()) for i in last]
                batch.n_tokens = 0
                for s, t in enumerate(picks):
                    add(t, pos[s], s, True)
                    pos[s] += 1
                last = list(range(len(prompts)))
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed in a decode step")
            return time.perf_counter() - t0
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)

    def perplexity(self, ids: list[int], bos: int) -> tuple[float, int]:
        nll, scored = 0.0, 0
        for begin, end, new in windows(ids):
            chunk = [bos, *ids[begin:end]]
            self.llm.reset()
            self.llm.eval(chunk)
            logits = np.asarray(self.llm.scores[: len(chunk) - 1])
            nll += log_softmax_nll(logits[-new:], np.asarray(chunk[1:])[-new:])
            scored += new
        return math.exp(nll / scored), scored


class Agent:
    def __init__(self, folder: str, threads: int, n_ctx: int) -> None:
        from edge_agent.backends import SessionOptions
        from edge_agent.models.catalog import inspect_folder
        from edge_agent.models.llm import DecoderLM
        from edge_agent.serving.llm.scheduler import Limits, LLMScheduler

        self.lm = DecoderLM.open(inspect_folder(Path(folder)), "onnxruntime", SessionOptions(threads=threads))
        self.scheduler = LLMScheduler(self.lm, Limits(max_batch=4, batch_timeout_ms=0)).start()

    def _params(self, n: int):
        from edge_agent.models.sampling import SamplingParams

        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    def one(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        handle = self.scheduler.submit(prompt, self._params(n))
        times = []
        for event in handle:
            if event.token_id is not None:
                times.append(time.perf_counter())
        handle.result()
        return t0, times

    def four(self, prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        handles = [self.scheduler.submit(p, self._params(n)) for p in prompts]
        for h in handles:
            h.result()
        return time.perf_counter() - t0

    def perplexity(self, ids: list[int], bos: int) -> tuple[float, int]:
        lm, nll, scored = self.lm, 0.0, 0
        for begin, end, new in windows(ids):
            chunk = [bos, *ids[begin:end]]
            past, done, rows = lm._empty_past(1), 0, []
            for start in range(0, len(chunk), 256):  # bounded memory: 256 positions of 262k logits at a time
                piece = np.asarray([chunk[start : start + 256]], dtype=np.int64)
                mask = np.ones((1, done + piece.shape[1]), dtype=np.int64)
                logits, past = lm.forward(piece, mask, past, every_position=True)
                rows.append(logits[0])
                done += piece.shape[1]
            logits = np.concatenate(rows)[:-1]
            nll += log_softmax_nll(logits[-new:], np.asarray(chunk[1:])[-new:])
            scored += new
        return math.exp(nll / scored), scored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=("llamacpp", "agent"))
    ap.add_argument("model")
    ap.add_argument("--prompts", type=Path, required=True, help="JSON: {by_length: {P: [ids...]}, text_ids, bos}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--perplexity", type=int, default=0, help="score the text's first N tokens instead of speed")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = json.loads(args.prompts.read_text())
    n = args.new_tokens
    if args.engine == "agent":  # as the daemon loads an engine: its files verified against the cache's hashes first
        from edge_agent.engines.cache import sha256_file

        for path in sorted(p for p in Path(args.model).iterdir() if p.is_file()):
            sha256_file(path)
    t_load = time.perf_counter()
    if args.perplexity:
        engine = (
            LlamaCpp(args.model, args.threads, 1100, logits_all=True)
            if args.engine == "llamacpp"
            else Agent(args.model, args.threads, 1100)
        )
        ppl, scored = engine.perplexity(spec["text_ids"][: args.perplexity], spec["bos"])
        args.out.write_text(json.dumps({"perplexity": ppl, "tokens_scored": scored, "peak_rss_mb": peak_rss_mb()}))
        if args.engine == "agent":
            engine.scheduler.stop()
        return 0
    longest = max(int(p) for p in spec["by_length"])
    cls = LlamaCpp if args.engine == "llamacpp" else Agent
    engine = cls(args.model, args.threads, 4 * (longest + n) + 64)
    load_s = time.perf_counter() - t_load
    result: dict = {"load_s": load_s, "prefill": {}}
    engine.one(spec["by_length"][str(min(int(p) for p in spec["by_length"]))][0], 8)  # warm-up
    for length, prompts in sorted(spec["by_length"].items(), key=lambda kv: int(kv[0])):
        t0, times = engine.one(prompts[0], n if int(length) == 128 else 2)
        ttft = times[0] - t0
        result["prefill"][length] = {"ttft_ms": 1e3 * ttft, "prefill_tok_s": int(length) / ttft}
        if int(length) == 128:
            result["decode_tok_s"] = (len(times) - 1) / (times[-1] - times[0])
            result["tokens"] = len(times)
    wall = engine.four(spec["by_length"]["128"][1:5], n)
    result["concurrent4_tok_s"] = 4 * n / wall
    result["peak_rss_mb"] = peak_rss_mb()
    if args.engine == "agent":
        engine.scheduler.stop()
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
