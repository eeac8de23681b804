"""``edge-agent eval asr``: WER/CER and latency of a speech model over an audio manifest (the
evaluation itself is ``edge_agent/bench/eval_asr.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench.eval_asr import evaluate


def _print_report(report: dict) -> None:
    print(
        f"{report['model']} on {report['data']} ({report['utterances']} utterances, {report['audio_s']:.0f} s, "
        f"{report['backend']} {report['device']} {report['precision']}, {report['threads']} thread(s))"
    )
    print(f"{'mode/decoder':<18}{'WER %':>8}{'S':>6}{'D':>6}{'I':>6}{'words':>7}{'CER %':>8}")
    for key, r in report["results"].items():
        w, c = r["wer"], r["cer"]
        print(
            f"{key:<18}{100 * w['rate']:>8.2f}{w['substitutions']:>6}{w['deletions']:>6}{w['insertions']:>6}"
            f"{w['ref_len']:>7}{100 * c['rate']:>8.2f}"
        )
    lat = report["latency"]
    print(
        f"latency: RTF {lat['rtf']:.4f}; per {lat['chunk_ms']:.0f} ms chunk P50 "
        f"{lat['compute_per_chunk_ms_p50']:.2f} / P95 {lat['compute_per_chunk_ms_p95']:.2f} ms; "
        f"final_ms P50 {lat['final_ms_p50']:.2f} / "
        f"P95 {lat['final_ms_p95']:.2f} (n={lat['count']}); streamed vs whole max |Δ log-prob| "
        f"{report['stream_vs_full_max_abs_diff']:.2e}"
    )


def cmd_eval_asr(args: argparse.Namespace) -> int:
    from ..config import load_settings

    settings = load_settings(args.config)
    report = evaluate(
        args.model or settings.models.asr[0].model,
        Path(args.data),
        backend=args.backend,
        device=args.device,
        precision=args.precision,
        threads=args.threads,
        decoders=tuple(args.decoder) if args.decoder else None,
        limit=args.limit,
        cache_dir=settings.models.cache_dir,
        audio=settings.audio,
    )
    if args.json is None:
        _print_report(report)
    elif args.json == "-":
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _print_report(report)
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="accuracy of a model over a data manifest")
    esub = p.add_subparsers(dest="eval_command", metavar="WORKLOAD", required=True)
    q = esub.add_parser("asr", help="WER/CER and latency of a streaming CTC speech model over an audio manifest")
    q.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    q.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="OUT",
        help="write the report as JSON to OUT (or, without OUT, print only JSON on stdout)",
    )
    q.add_argument("--model", help="demo model name or model folder (default: the top configured ASR tier)")
    q.add_argument("--data", required=True, metavar="MANIFEST", help='JSONL: {"audio": "rel/path.wav", "text": "..."}')
    q.add_argument("--backend", choices=["onnxruntime", "openvino", "tensorrt"], default="onnxruntime")
    q.add_argument("--device", default="cpu")
    q.add_argument("--precision", choices=["auto", "fp32", "fp16", "bf16", "int8"], default="auto")
    q.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    q.add_argument(
        "--decoder",
        action="append",
        choices=["greedy", "lexicon", "lm"],
        help="decoder(s) to score (default: greedy, plus lexicon when the folder has lexicon.txt, "
        "plus lm when it also has lm.arpa)",
    )
    q.add_argument("--limit", type=int, help="score only the first N utterances")
    q.set_defaults(func=cmd_eval_asr)
