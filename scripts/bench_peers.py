"""Driver of scripts/bench-peers: edge-agent against onnxruntime-genai, OpenVINO GenAI and llama.cpp.

Runs in .venv (it needs only the standard library, numpy, tokenizers and edge_agent.bench.peers). Every
engine runs in its own process, on the same weights, with the same thread count and the same prompt
token ids, in interleaved rounds: each round runs every engine once (their order rotated from round to
round), for each model, so that noise from other jobs on the machine hits all engines alike. Per run:
- edge-agent: ``edge-agent bench llm`` as the daemon serves the tier (scheduler, limits, sampling,
  detokenization) with ``--model`` one of two fp32 folders of the same weights: the in-place KV graph an
  ONNX Runtime build serves (row ``edge-agent``, the reference of the ratios) and the plain export as it
  is (row ``edge-agent plain``); the engine cache is an empty one, so that neither is replaced by an int8
  engine that may be cached for the demo model;
- the peers: scripts/bench_peers_worker.py in the environment that has each one.
Each engine makes a batch-1 run (requests one at a time: decode and prefill figures) and a C-client
run (TTFT and tokens/s). Writes the JSON report and prints the table of edge_agent/bench/peers.py.

    .venv/bin/python scripts/bench_peers.py --cache DIR [--models A,B] [--rounds 3] [--json OUT] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edge_agent.bench import peers

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "scripts" / "bench_peers_worker.py"
SEED = 1234  # bench llm's prompt seed
# engine -> (python, worker engine, artifact under the model's cache folder)
PEERS = {
    "onnxruntime-genai": (".venv", "ortgenai", "genai"),
    "openvino-genai": (".venv-peers", "ovgenai", "ov"),
    "llama.cpp f32": (".venv-peers", "llamacpp", "f32.gguf"),
    "llama.cpp f16": (".venv-peers", "llamacpp", "f16.gguf"),
}
# edge-agent's rows -> the folder it serves: the fp32 in-place KV graph that an ONNX Runtime build of the
# export serves (``edge-agent engines convert --inplace-kv``, what the daemon prefers), and the export as it is
AGENT_PLAIN = "edge-agent plain"
AGENTS = {peers.AGENT: "inplace", AGENT_PLAIN: "plain", "edge-agent int4": "int4"}
ENGINES = (*AGENTS, *PEERS)


def prompts_for(folder: Path, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` ids, drawn as ``bench llm`` draws them (normal vocabulary, seeded)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    gen = (
        json.loads((folder / "generation_config.json").read_text())
        if (folder / "generation_config.json").is_file()
        else {}
    )
    high = min(tok.get_vocab_size(with_added_tokens=False), int(config.get("vocab_size") or 1 << 30))
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    special = set(eos if isinstance(eos, list) else [eos]) | {config.get("bos_token_id")}
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(n):
        ids = rng.integers(3, high, size=length)
        for j, v in enumerate(ids):
            while int(v) in special:
                v = rng.integers(3, high)
            ids[j] = v
        out.append([int(v) for v in ids])
    return out


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[bool, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return proc.returncode == 0, tail[0][:200]


def agent_run(args, folder: Path, clients: int, n: int, out: Path, config: Path) -> dict:
    cmd = [str(ROOT / ".venv/bin/python"), "-c", "import sys; from edge_agent.cli import main; sys.exit(main())"]
    cmd += ["bench", "llm", "--config", str(config), "--model", str(folder)]
    cmd += ["--threads", str(args.threads), "--concurrency", str(clients), "--requests", str(n), "--rounds", "1"]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--no-baseline", "--genai", "none", "--quiet", "--json", str(out)]
    src = os.environ.get("BENCH_PEERS_AGENT_SRC")  # the committed edge_agent/ (scripts/bench-peers)
    env = {**os.environ, "PYTHONPATH": src} if src else None
    ok, why = run(cmd, args.timeout, env)
    if not ok:
        raise RuntimeError(why)
    report = json.loads(out.read_text())
    agent = report["agent"]
    if clients == 1:
        figures = {
            "decode_tps": agent["decode_tokens_per_s"],
            "prefill_tps": args.prompt_tokens / (agent["ttft_ms"]["p50"] / 1000.0),
        }
    else:
        figures = {"c4_ttft_ms": agent["ttft_ms"]["p50"], "c4_tps": agent["tokens_per_s"]}
    return {"figures": figures, "header": report["header"]}


def peer_run(args, engine: str, artifact: Path, clients: int, prompts: Path, out: Path) -> dict:
    venv, kind, _ = PEERS[engine]
    cmd = [str(ROOT / venv / "bin/python"), str(WORKER), kind, str(artifact), "--prompts", str(prompts)]
    cmd += ["--concurrency", str(clients), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    ok, why = run([*cmd, "--out", str(out)], args.timeout)
    if not ok:
        raise RuntimeError(why)
    report = json.loads(out.read_text())
    if "skipped" in report:
        return {"skipped": report["skipped"]}
    ttft = [r["ttft_ms"] for r in report["requests"]]
    if clients == 1:
        itl = [x for r in report["requests"] for x in r["itl_ms"]]
        figures = peers.single_figures(ttft, itl, args.prompt_tokens)
    else:
        figures = peers.concurrent_figures(ttft, report["tokens"], report["wall_s"])
    return {"figures": figures, "version": report.get("version"), "note": report.get("note")}


def unavailable(args, model: str, engine: str) -> str | None:
    """Why an engine cannot run on a model (its artifact or environment is missing), else None."""
    if engine in AGENTS:
        path = args.cache / model / AGENTS[engine]
        reason = path.with_name(path.name + ".reason")
        if not path.exists():
            return reason.read_text().strip() if reason.exists() else f"no {AGENTS[engine]} folder built"
        return None
    venv, _, artifact = PEERS[engine]
    if not (ROOT / venv / "bin/python").exists():
        return f"{venv} missing (scripts/bench-peers-setup)"
    if engine.startswith("llama.cpp"):
        status = (
            (ROOT / venv / "llamacpp.status").read_text().strip()
            if (ROOT / venv / "llamacpp.status").exists()
            else "not built"
        )
        if status != "ok":
            return status
    path = args.cache / model / artifact
    reason = path.with_name(path.name + ".reason")
    if not path.exists():
        return reason.read_text().strip() if reason.exists() else f"no {artifact} built"
    return None


def paired(rounds: dict, models: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    """Batch-1 decode of one engine over another, per round (both ran in it) and their median."""
    lines = []
    for model in models:
        for a, b in pairs:
            x, y = rounds[model].get(a, {}).get("decode_tps", []), rounds[model].get(b, {}).get("decode_tps", [])
            per = [u / v for u, v in zip(x, y) if v]
            if per:
                lines.append(
                    f"{model}: {a} / {b} batch-1 decode ×{peers.median(per):.2f} "
                    f"(rounds: {', '.join(f'{r:.2f}' for r in per)})"
                )
    return lines


def machine() -> dict:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    commit = subprocess.run(
        ["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "edge_agent"], capture_output=True, text=True, cwd=ROOT)
    src = os.environ.get("BENCH_PEERS_AGENT_SRC")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
        "commit": commit,
        "edge_agent_from": "the commit (git archive)" if src else "the working tree",
        "uncommitted_edge_agent_files": len(dirty.stdout.splitlines()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cache", type=Path, required=True, help="peer artifacts: CACHE/MODEL/{plain,genai,ov,f32.gguf,f16.gguf}"
    )
    p.add_argument("--models", default="demo-phi3-small,random-phi3-438m")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="clients of the concurrent run (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=2, help="batch-1 requests per run (default 2)")
    p.add_argument("--requests-concurrent", type=int, default=4, help="requests per concurrent run (default 4)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one run")
    p.add_argument("--json", dest="json_out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    models, engines = args.models.split(","), args.engines.split(",")
    meta = machine()
    rounds: dict = {m: {e: {f: [] for f in peers.FIGURES} for e in engines} for m in models}
    reasons: dict = {}
    info: dict = {}
    loads: list[float] = []  # 1-minute load average before each run
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "engines").mkdir()
        config = work / "agent.toml"  # an empty engine cache: the daemon's path on the plain fp32 folder
        config.write_text(f'[engines]\ncache_dir = "{work / "engines"}"\n')
        for model in models:
            folder = (args.cache / model / "plain").resolve()
            # bench llm measures prompts[:n] (the same draws); the peers' warm-up is another prompt, because
            # OpenVINO GenAI's prefix cache would serve a measured prompt seen in the warm-up from its cache.
            for n in (args.requests, args.requests_concurrent):
                prompts = prompts_for(folder, n + 1, args.prompt_tokens)
                (work / f"{model}-{n}.json").write_text(json.dumps({"warmup": prompts[n], "prompts": prompts[:n]}))
            for engine in engines:
                why = unavailable(args, model, engine)
                if why:
                    reasons[(model, engine)] = {"*": why}
        for r in range(args.rounds):
            for model in models:
                order = engines[r % len(engines) :] + engines[: r % len(engines)]
                for engine in order:
                    if (model, engine) in reasons and "*" in reasons[(model, engine)]:
                        continue
                    for clients, n in ((1, args.requests), (args.concurrency, args.requests_concurrent)):
                        out = work / "out.json"
                        t0 = time.perf_counter()
                        loads.append(os.getloadavg()[0])
                        try:
                            if engine in AGENTS:
                                folder = (args.cache / model / AGENTS[engine]).resolve()
                                res = agent_run(args, folder, clients, n, out, config)
                            else:
                                artifact = args.cache / model / PEERS[engine][2]
                                res = peer_run(args, engine, artifact, clients, work / f"{model}-{n}.json", out)
                        except (RuntimeError, subprocess.TimeoutExpired) as exc:
                            res = {"skipped": f"failed: {exc}"}
                        if "skipped" in res:
                            keys = ("decode_tps", "prefill_tps") if clients == 1 else ("c4_ttft_ms", "c4_tps")
                            reasons.setdefault((model, engine), {}).update({k: res["skipped"] for k in keys})
                        else:
                            for k, v in res["figures"].items():
                                rounds[model][engine][k].append(v)
                            info.setdefault(f"{model}/{engine}", {k: v for k, v in res.items() if k != "figures"})
                        print(
                            f"round {r + 1}/{args.rounds} {model} {engine} C={clients}: "
                            + (res.get("skipped") or ", ".join(f"{k} {v:.1f}" for k, v in res["figures"].items()))
                            + f" ({time.perf_counter() - t0:.0f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["loadavg_runs"] = {"min": min(loads, default=0.0), "max": max(loads, default=0.0)}
    summary = peers.summarize(rounds)
    table = peers.format_table(summary, engines, reasons)
    print(table)
    print(
        f"\nmedians [min–max] over {args.rounds} interleaved rounds; ×r = edge-agent / engine (above 1: edge-agent "
        f"has more tok/s, or a longer TTFT); P={args.prompt_tokens} T={args.max_new_tokens}, {args.threads} threads, "
        f"C={args.concurrency}; edge-agent from {meta['edge_agent_from']} {meta['commit'].split()[0]}; "
        f"{meta['cpu']}, {meta['cores']} cores, "
        f"1-min load average {meta['loadavg_runs']['min']:.1f}–{meta['loadavg_runs']['max']:.1f} before the runs"
    )
    pairs = paired(
        rounds,
        models,
        [(peers.AGENT, "onnxruntime-genai"), ("edge-agent int4", peers.AGENT), ("edge-agent int4", "llama.cpp f16")],
    )
    if pairs:
        print("\n".join(["", *pairs]))
    report = {
        "pairs": pairs,
        "machine": meta,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": rounds,
        "summary": summary,
        "reasons": {f"{m}/{e}": v for (m, e), v in reasons.items()},
        "runs": info,
        "table": table,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(summary, engines, args.plot)
    return 0


def plot(summary: dict, engines: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'edge-agent[plot]'); skipped", file=sys.stderr)
        return
    models = list(summary)
    fig, axes = plt.subplots(
        len(models), len(peers.FIGURES), figsize=(4 * len(peers.FIGURES), 3 * len(models)), squeeze=False
    )
    for i, model in enumerate(models):
        for j, f in enumerate(peers.FIGURES):
            ax = axes[i][j]
            names = [e for e in engines if f in summary[model].get(e, {})]
            med = [summary[model][e][f]["median"] for e in names]
            lo = [m - summary[model][e][f]["min"] for m, e in zip(med, names)]
            hi = [summary[model][e][f]["max"] - m for m, e in zip(med, names)]
            ax.bar(range(len(names)), med, yerr=[lo, hi], color=["C0" if e in AGENTS else "C7" for e in names])
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{model}: {peers.HEADINGS[f]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
