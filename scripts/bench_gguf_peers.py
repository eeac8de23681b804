"""edge-agent against llama.cpp on the identical GGUF file: speed, memory and perplexity, interleaved rounds.

Engines (each measured in a fresh process per round by scripts/bench_gguf_worker.py, same threads):
- llama.cpp (llama-cpp-python, compiled for this CPU) on the file as shipped (Q4_K_M) and on its
  requantizations (llama.cpp's own ``llama_model_quantize``; ``--requant``, default Q8_0 and F16 from the shipped
  file; Q4_0 and Q4_K_M from its F32 requantization, the fp32 weights edge-agent imports);
- edge-agent on what it builds from the same file: the imported float32 folder and any engine folders
  given with ``--agent LABEL=FOLDER`` (e.g. the int8w / int4 engines ``edge-agent build`` makes).

Figures per engine, medians over the rounds with their min–max: TTFT and prefill tok/s at 128 and 1,024
prompt tokens, batch-1 decode tok/s (128 new tokens), aggregate tok/s with 4 requests at once (llama.cpp:
batched decoding of 4 sequences, as llama-server's slots; edge-agent: its continuous batching), peak RSS,
and (once, deterministic) perplexity on the held-out text's first N tokens. Ratios are against llama.cpp
on the shipped file.

    .venv/bin/python scripts/bench_gguf_peers.py --gguf FILE --imported DIR [--agent int4=DIR ...]
        [--rounds 3] [--threads 2] [--perplexity-tokens 4096] [--json OUT] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "scripts" / "bench_gguf_worker.py"
LLAMA_PY = ROOT / ".venv-llamacpp" / "bin" / "python"
TEXT = ROOT / "calibration" / "llm" / "text" / "python-reference.txt"
# llama_ftype: LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_Q4_0, MOSTLY_Q4_K_M
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2, "q4_k_m": 15}
# The 4-bit requantizations start from the F32 one: the shipped blocks dequantized exactly, the same fp32
# weights edge-agent's import holds, so llama.cpp's 4-bit methods and edge-agent's start from one place.
FROM_F32 = ("q4_0", "q4_k_m")

METRICS = [
    ("prefill 128: TTFT ms", lambda r: r["prefill"]["128"]["ttft_ms"], False),
    ("prefill 128: tok/s", lambda r: r["prefill"]["128"]["prefill_tok_s"], True),
    ("prefill 1024: TTFT ms", lambda r: r["prefill"]["1024"]["ttft_ms"], False),
    ("prefill 1024: tok/s", lambda r: r["prefill"]["1024"]["prefill_tok_s"], True),
    ("decode tok/s (batch 1)", lambda r: r["decode_tok_s"], True),
    ("4 at once: tok/s", lambda r: r["concurrent4_tok_s"], True),
    ("peak RSS MB", lambda r: r["peak_rss_mb"], False),
]


def requantize(src: Path, dst: Path, kind: str) -> None:
    if dst.is_file():
        return
    code = (
        "import sys, llama_cpp as L\n"
        "p = L.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); p.nthread = 2\n"
        "p.allow_requantize = True  # from the shipped blocks, as llama-quantize --allow-requantize\n"
        "rc = L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(rc)\n"
    )
    tmp = dst.with_suffix(".partial")
    done = subprocess.run([str(LLAMA_PY), "-c", code, str(src), str(tmp), str(FTYPES[kind])], capture_output=True)
    if done.returncode != 0:
        sys.exit(f"bench-gguf-peers: llama.cpp could not requantize to {kind}: {done.stderr.decode()[-300:]}")
    tmp.rename(dst)


def prompts(imported: Path, out: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(imported / "tokenizer.json"))
    bos = json.loads((imported / "config.json").read_text())["bos_token_id"]
    ids = tok.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False).ids
    by_length = {
        "128": [[bos, *ids[3000 + k * 200 : 3000 + k * 200 + 127]] for k in range(5)],
        "1024": [[bos, *ids[8000:9023]]],
    }
    out.write_text(json.dumps({"by_length": by_length, "text_ids": ids, "bos": bos}))


def run_worker(engine: str, model: str, spec: Path, threads: int, extra: list[str]) -> dict:
    python = str(LLAMA_PY) if engine == "llamacpp" else sys.executable
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(WORKER), engine, model, "--prompts", str(spec), "--threads", str(threads), "--out", out.name]
        done = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
        return json.loads(Path(out.name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--imported", type=Path, required=True, help="the folder edge-agent models import wrote")
    ap.add_argument("--agent", action="append", default=[], metavar="LABEL=FOLDER")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--perplexity-tokens", type=int, default=4096)
    ap.add_argument(
        "--requant", default="q8_0,f16", help=f"llama.cpp requantizations, comma-separated of {', '.join(FTYPES)}"
    )
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edge-agent" / "bench" / "gguf")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if not LLAMA_PY.is_file():
        sys.exit(f"bench-gguf-peers: no {LLAMA_PY}: run scripts/bench-gguf-peers (it builds llama-cpp-python)")
    args.work.mkdir(parents=True, exist_ok=True)
    engines: dict[str, tuple[str, str]] = {"llama.cpp Q4_K_M": ("llamacpp", str(args.gguf))}
    kinds = [k for k in args.requant.split(",") if k]
    unknown = [k for k in kinds if k not in FTYPES]
    if unknown:
        sys.exit(f"bench-gguf-peers: --requant {','.join(unknown)}: choose among {', '.join(FTYPES)}")
    stem = args.gguf.stem.split("-q")[0]
    f32 = args.work / f"{stem}-f32.gguf"
    for kind in kinds:
        dst = args.work / f"{stem}-{kind}.gguf"
        if kind in FROM_F32:
            print("bench-gguf-peers: requantizing to f32 (llama.cpp)", file=sys.stderr, flush=True)
            requantize(args.gguf, f32, "f32")
        print(f"bench-gguf-peers: requantizing to {kind} (llama.cpp)", file=sys.stderr, flush=True)
        requantize(f32 if kind in FROM_F32 else args.gguf, dst, kind)
        label = f"{kind.upper()} (from F32)" if kind in FROM_F32 else kind.upper()
        engines[f"llama.cpp {label}"] = ("llamacpp", str(dst))
    engines["edge-agent fp32"] = ("agent", str(args.imported))
    for item in args.agent:
        label, _, folder = item.partition("=")
        engines[f"edge-agent {label}"] = ("agent", folder)
    spec = args.work / "prompts.json"
    prompts(args.imported, spec)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    order = list(engines)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # a different engine first each round
            print(f"bench-gguf-peers: round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            runs[name].append(run_worker(*engines[name], spec, args.threads, []))
    ppl: dict[str, dict] = {}
    if args.perplexity_tokens:
        for name, (engine, model) in engines.items():
            print(f"bench-gguf-peers: perplexity: {name}", file=sys.stderr, flush=True)
            ppl[name] = run_worker(engine, model, spec, args.threads, ["--perplexity", str(args.perplexity_tokens)])
    table = summarize(runs, ppl)
    print(render(table, args))
    if args.json:
        args.json.write_text(
            json.dumps({"engines": engines, "runs": runs, "perplexity": ppl, "table": table}, indent=2)
        )
    if args.plot:
        plot(table, args.plot)
    return 0


def summarize(runs: dict[str, list[dict]], ppl: dict[str, dict]) -> dict:
    table: dict = {}
    for name, results in runs.items():
        good = [r for r in results if "error" not in r]
        row: dict = {"rounds": len(good), "errors": [r["error"] for r in results if "error" in r]}
        for label, get, _ in METRICS:
            values = [get(r) for r in good]
            if values:
                row[label] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        if name in ppl and "perplexity" in ppl[name]:
            row["perplexity"] = ppl[name]["perplexity"]
            row["perplexity_tokens"] = ppl[name]["tokens_scored"]
        table[name] = row
    return table


def render(table: dict, args: argparse.Namespace) -> str:
    base = table.get("llama.cpp Q4_K_M", {})
    names = list(table)
    lines = [
        f"{args.gguf.name}, {args.threads} threads, medians of {args.rounds} rounds (min–max); "
        "ratio = / llama.cpp Q4_K_M",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, _, _higher in METRICS:
        cells = []
        for name in names:
            cell = table[name].get(label)
            if cell is None:
                cells.append("—")
                continue
            text = f"{cell['median']:.1f} ({cell['min']:.1f}–{cell['max']:.1f})"
            if label in base and name != "llama.cpp Q4_K_M":
                text += f" · {cell['median'] / base[label]['median']:.2f}×"
            cells.append(text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ppl_cells = []
    for name in names:
        value = table[name].get("perplexity")
        ref = base.get("perplexity")
        ppl_cells.append(
            "—"
            if value is None
            else f"{value:.3f}" + (f" ({100 * (value / ref - 1):+.2f}%)" if ref and name != "llama.cpp Q4_K_M" else "")
        )
    tokens = next((table[n]["perplexity_tokens"] for n in names if "perplexity_tokens" in table[n]), 0)
    lines.append(f"| perplexity ({tokens} tokens) | " + " | ".join(ppl_cells) + " |")
    errors = [f"{n}: {e}" for n in names for e in table[n]["errors"]]
    if errors:
        lines += ["", "errors: " + "; ".join(errors)]
    return "\n".join(lines)


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ["decode tok/s (batch 1)", "prefill 1024: tok/s", "4 at once: tok/s", "peak RSS MB"]
    names = list(table)
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4.2))
    for ax, label in zip(axes, shown):
        med = [table[n].get(label, {}).get("median", 0) for n in names]
        lo = [m - table[n].get(label, {}).get("min", m) for n, m in zip(names, med)]
        hi = [table[n].get(label, {}).get("max", m) - m for n, m in zip(names, med)]
        colors = ["#999999" if n.startswith("llama") else "#1f77b4" for n in names]
        ax.bar(range(len(names)), med, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(
            range(len(names)),
            [n.replace("edge-agent ", "ea ").replace("llama.cpp ", "lc ") for n in names],
            rotation=45,
            ha="right",
        )
        ax.set_title(label)
    fig.suptitle("edge-agent (blue) vs llama.cpp (grey) on the same Gemma 3 270M GGUF")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
