"""``edge-agent eval asr``: WER/CER and latency of a speech model over an audio manifest; ``edge-agent eval
llm``: perplexity of an LLM over held-out text (the evaluations themselves are ``edge_agent/bench/eval_asr.py``
and ``edge_agent/bench/eval_llm.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench.eval_asr import evaluate


def _print_report(report: dict) -> None:
    if "per_voice" in report:  # a Whisper model's report (bench/eval_whisper.py)
        from ..bench.eval_whisper import format_whisper_report

        print(format_whisper_report(report))
        return
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
    if lat.get("first_stable_ms_p50") is not None:
        print(
            f"first stable word at {lat['first_stable_ms_p50']:.0f} ms (P50) / {lat['first_stable_ms_p95']:.0f} ms "
            "(P95) into the clip"
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
        prompt=settings.asr.prompt_text() if args.prompt is None else args.prompt,
        final_padding_s=settings.asr.final_padding_s,
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


def _print_llm(report: dict) -> None:
    limit = f", first {report['max_tokens']}" if report["max_tokens"] else ""
    bos = "first in every window" if report["bos"] is not None else "none"
    print(
        f"{report['model']} on {report['text']} ({report['text_tokens']} tokens{limit}; window "
        f"{report['window']}, stride {report['stride']}, BOS {bos}; "
        f"{report['backend']}, {report['threads']} thread(s))"
    )
    print(
        f"perplexity {report['perplexity']:.4f} over {report['tokens']} tokens scored ({report['windows']} windows, "
        f"{report['forwarded_tokens']} tokens fed) in {report['seconds']:.1f} s: {report['tokens_per_s']:.1f} tokens/s"
    )


def cmd_eval_llm(args: argparse.Namespace) -> int:
    from ..bench.eval_llm import evaluate
    from ..config import load_settings
    from ..progress import Progress

    settings = load_settings(args.config)
    model = args.model or settings.models.llm[0].model
    with Progress("perplexity", "tokens", enabled=args.json != "-") as bar:
        report = evaluate(
            model,
            Path(args.text),
            window=args.window,
            stride=args.stride,
            max_tokens=args.max_tokens,
            chunk=args.chunk,
            backend=args.backend,
            threads=args.threads,
            cache_dir=settings.models.cache_dir,
            progress=bar.update,
        )
    if args.json is None:
        _print_llm(report)
    elif args.json == "-":
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _print_llm(report)
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="accuracy of a model over a data manifest")
    esub = p.add_subparsers(dest="eval_command", metavar="WORKLOAD", required=True)
    q = esub.add_parser(
        "asr", help="WER/CER and latency of a speech model (streaming CTC or Whisper) over an audio manifest"
    )
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
    q.add_argument(
        "--prompt",
        default=None,
        metavar="WORDS",
        help="Whisper: words to expect, its initial prompt (default: the [asr] prompt words; '' for none)",
    )
    q.set_defaults(func=cmd_eval_asr)

    m = esub.add_parser(
        "llm",
        help="perplexity of an LLM over held-out text (sliding windows, BOS first in each, KV cache carried)",
    )
    m.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    m.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="OUT",
        help="write the report as JSON to OUT (or, without OUT, print only JSON on stdout)",
    )
    m.add_argument(
        "--model", help="demo or imported model name, or model folder (default: the top configured LLM tier)"
    )
    m.add_argument(
        "--text",
        required=True,
        metavar="FILE",
        help='a UTF-8 text file, or a JSONL manifest of {"text"} / {"prompt"} lines',
    )
    m.add_argument("--window", type=int, default=1024, help="tokens per window, BOS not counted (default 1024)")
    m.add_argument(
        "--stride", type=int, default=512, help="tokens between window starts, at most --window (default 512)"
    )
    m.add_argument("--max-tokens", type=int, metavar="N", help="score only the text's first N tokens")
    m.add_argument("--chunk", type=int, default=256, help="tokens fed per model call, KV cache carried (default 256)")
    m.add_argument("--backend", choices=["onnxruntime", "openvino"], default="onnxruntime")
    m.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    m.set_defaults(func=cmd_eval_llm)
