"""``edge-agent bench asr``: streaming recognition of N concurrent streams against one-pass decoding.

Each round:
- **streaming**: N streams replay the same speech in real time (20 ms blocks, as microphones
  would; start times spread by a seeded random offset under 1 s) through one ``AsrService``: VAD
  endpointing, chunked steps, dynamic batching across streams. Per utterance: ``first_partial_ms``,
  ``final_ms``, ``rtf``;
- **baseline**: the same utterances (the exact segments the endpointer cut) decoded in one
  non-streaming pass each (``engine.transcribe``), one after another: its ``final_ms`` is the pass
  itself (what a user waits after the end of speech if nothing was decoded while they spoke).

``first_text_ms`` puts both on one axis: first voiced audio → first text on screen (streaming: the
first partial; baseline: the utterance's duration + its pass). ``first_prefix_ms`` is first voiced
audio → the first partial whose text begins the final text (the first text that is never taken
back; a model may guess a letter or two before any speech, which ``first_partial_ms`` counts).
Figures are medians over rounds. ``--compare`` runs the fixed-wait configuration and the adaptive one
side by side instead (``bench/asr_compare.py``).
Audio: ``--audio FILE`` (repeatable), else a few sentences synthesised with espeak-ng when it is
installed, else a synthetic speech-like signal (said in the report).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError
from ..models.ctc_lexicon import DECODERS
from .asr_replay import SEED, median_rounds, run_baseline, run_streaming, segments, setup, summarize


def _streams(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams: {text!r} is not a number or a comma list (1,4)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--streams: {text!r}: give counts of at least 1")
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "asr",
        help="benchmark streaming ASR with N concurrent streams against one-pass decoding",
        description="Replay speech on N concurrent streams in real time through the streaming ASR service "
        "(endpointing, dynamic batching) and decode the same utterances in one pass each; report "
        "first-partial / final / first-text percentiles and RTF side by side.",
    )
    p.add_argument(
        "--streams",
        type=_streams,
        default=[1],
        metavar="N[,N…]",
        help="concurrent streams (default 1; a comma list with --compare, e.g. 1,4)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="the fixed batching wait and whole first chunk (the previous behaviour) against the adaptive "
        "wait and early first step, in alternating rounds, side by side with ratios",
    )
    p.add_argument("--model", default=None, help="ASR demo model or folder (default: the top configured ASR tier)")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "openvino"))
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians reported (default 3)")
    p.add_argument("--audio", action="append", default=[], metavar="FILE", help="speech to replay (repeatable)")
    p.add_argument("--max-batch", type=int, default=None, help="default: batching.max_batch")
    p.add_argument("--batch-timeout-ms", type=float, default=None, help="default: batching.batch_timeout_ms")
    p.add_argument(
        "--decoder",
        choices=DECODERS,
        default="auto",
        help="CTC decoding; auto = the folder's lexicon + LM when it has them (default)",
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--plot", metavar="PNG", default=None, help="CDFs of final and first-text latency, RTF bars")
    p.add_argument("--config", metavar="FILE", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


# -- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from ..serving.asr.factory import make_service

    if args.rounds < 1:
        raise InputError("--rounds must be at least 1")
    if args.compare:
        from .asr_compare import run_compare

        return run_compare(args)
    if len(args.streams) != 1:
        raise InputError(f"--streams {args.streams}: one count, or a list with --compare")
    streams = args.streams[0]
    settings, batching, ref, engine, audio, audio_source = setup(args)
    stream_rounds: list[dict] = []
    base_rounds: list[dict] = []
    raw: dict[str, list[dict]] = {"streaming": [], "baseline": []}
    batch_sizes: dict[int, int] = {}
    same_text, compared = 0, 0
    try:
        service = make_service(engine, settings.audio, batching, streams=streams)
        segs = segments(engine, audio, service)
        engine.transcribe(segs[0] if segs else audio[:16000])  # warm-up
        for r in range(args.rounds):
            service = make_service(engine, settings.audio, batching, streams=streams).start()
            try:
                rows, _wall = run_streaming(service, audio, streams, SEED + r)
            finally:
                service.stop()
            for size, n in service.batcher.batch_sizes.items():
                batch_sizes[size] = batch_sizes.get(size, 0) + n
            base = run_baseline(engine, segs, streams)
            stream_rounds.append(summarize(rows))
            base_rounds.append(summarize(base))
            raw["streaming"] += rows
            raw["baseline"] += base
            texts = [b["text"] for b in base[: len(segs)]]
            for k in range(streams):
                got = [row["text"] for row in rows[k * len(segs) : (k + 1) * len(segs)]]
                compared += len(texts)
                same_text += sum(a == b for a, b in zip(got, texts))
    finally:
        engine.close()
    total_batches = sum(batch_sizes.values())
    report = {
        "model": ref.name,
        "kind": engine.kind,
        "backend": args.backend,
        "threads": args.threads,
        "streams": streams,
        "rounds": args.rounds,
        "audio": audio_source,
        "utterances_per_stream": len(segs),
        "audio_s_per_stream": round(audio.size / 16000, 2),
        "batching": {
            "max_batch": batching.max_batch,
            "batch_timeout_ms": batching.batch_timeout_ms if streams > 1 else 0.0,
            "batches": total_batches,
            "sizes": dict(sorted(batch_sizes.items())),
            "mean_size": (sum(s * n for s, n in batch_sizes.items()) / total_batches) if total_batches else None,
        },
        "streaming": median_rounds(stream_rounds),
        "baseline": median_rounds(base_rounds),
        "final_text_equal_fraction": same_text / compared if compared else None,
        "notes": [
            "baseline: one non-streaming pass per utterance, sequential; final_ms = the pass",
            "first_text_ms: first voiced audio -> first text (baseline: utterance duration + pass)",
            "Whisper streams with LocalAgreement and a forced committed prefix: its final may differ "
            "from a one-pass decode; CTC finals equal it",
        ],
    }
    from .asr_report import format_table, plot_report

    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_report(report, raw, Path(args.plot))
    return 0
