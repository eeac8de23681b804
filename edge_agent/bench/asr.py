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
first partial; baseline: the utterance's duration + its pass). Figures are medians over rounds.
Audio: ``--audio FILE`` (repeatable), else a few sentences synthesised with espeak-ng when it is
installed, else a synthetic speech-like signal (said in the report).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..models.ctc_lexicon import DECODERS

SENTENCES = ("turn on the kitchen lights", "what is the weather like tomorrow morning", "set a timer for ten minutes")
SEED = 1234
METRICS = ("first_partial_ms", "final_ms", "first_text_ms", "rtf")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "asr",
        help="benchmark streaming ASR with N concurrent streams against one-pass decoding",
        description="Replay speech on N concurrent streams in real time through the streaming ASR service "
        "(endpointing, dynamic batching) and decode the same utterances in one pass each; report "
        "first-partial / final / first-text percentiles and RTF side by side.",
    )
    p.add_argument("--streams", type=int, default=1, metavar="N", help="concurrent streams (default 1)")
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


# -- audio ------------------------------------------------------------------------------------


def _synthetic(seconds: float, seed: int) -> np.ndarray:
    """Speech-like: voiced harmonic bursts (syllables) with pitch drift, under 60 ms gaps."""
    rng = np.random.default_rng(seed)
    out = [np.zeros(6400, np.float32)]
    while sum(map(len, out)) < seconds * 16000:
        n = int(rng.uniform(0.12, 0.3) * 16000)
        t = np.arange(n) / 16000
        f0 = rng.uniform(100, 220)
        syl = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 8)) * np.hanning(n) * 0.2
        out += [syl.astype(np.float32), np.zeros(int(rng.uniform(0.03, 0.08) * 16000), np.float32)]
    out.append(np.zeros(12800, np.float32))
    return np.concatenate(out)


def load_audio(files: Sequence[str]) -> tuple[list[np.ndarray], str]:
    from ..audio.wav import read_audio

    if files:
        return [read_audio(f)[0] for f in files], "files: " + ", ".join(files)
    if shutil.which("espeak-ng") and shutil.which("sox"):
        clips = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, text in enumerate(SENTENCES):
                raw, wav = Path(tmp) / f"{i}.raw.wav", Path(tmp) / f"{i}.wav"
                subprocess.run(
                    ["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), text],
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
                subprocess.run(
                    ["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav), "pad", "0.4", "0.9"],
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
                clips.append(read_audio(wav)[0])
        return clips, f"espeak-ng: {len(SENTENCES)} sentences"
    return [_synthetic(2.5, SEED + i) for i in range(3)], "synthetic speech-like signal (espeak-ng not installed)"


def segments(engine, audio, service) -> list[np.ndarray]:
    """The utterances the service's endpointer cuts from ``audio`` (what the streaming side decodes)."""
    from ..audio.vad import Endpointer, SpeechAudio, SpeechEnd, SpeechStart

    ep = Endpointer(service.detector_factory(), service.endpoint, engine.sample_rate)
    out, cur = [], None
    for e in ep.push(audio) + ep.flush():
        if isinstance(e, SpeechStart):
            cur = [e.audio]
        elif isinstance(e, SpeechAudio) and cur is not None:
            cur.append(e.audio)
        elif isinstance(e, SpeechEnd) and cur is not None:
            out.append(np.concatenate(cur))
            cur = None
    return out


# -- one round each way -------------------------------------------------------------------------


def run_streaming(service, audio: np.ndarray, streams: int, seed: int) -> tuple[list[dict], float]:
    offsets = np.random.default_rng(seed).uniform(0, 1.0, streams)
    results: list[list] = [[] for _ in range(streams)]
    block = 320

    def client(k: int) -> None:
        handle = service.open_stream()
        time.sleep(float(offsets[k]))
        start = time.monotonic()
        for i in range(0, len(audio), block):
            handle.feed(audio[i : i + block])
            delay = start + (i + block) / 16000 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        handle.close()
        handle.wait(120)
        results[k] = handle.finals

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    rows = []
    for finals in results:
        for f in finals:
            m = f.metrics
            rows.append(
                {
                    "text": f.text,
                    "first_partial_ms": m.first_partial_ms,
                    "final_ms": m.final_ms,
                    "rtf": m.rtf,
                    "audio_s": m.audio_s,
                    "first_text_ms": m.first_partial_ms
                    if m.first_partial_ms is not None
                    else m.audio_s * 1e3 + m.final_ms,
                }
            )
    return rows, wall


def run_baseline(engine, segs: list[np.ndarray], streams: int) -> list[dict]:
    rows = []
    for _ in range(streams):
        for seg in segs:
            t0 = time.perf_counter()
            hyp = engine.transcribe(seg)
            ms = (time.perf_counter() - t0) * 1e3
            audio_s = seg.size / 16000
            rows.append(
                {
                    "text": hyp.text,
                    "final_ms": ms,
                    "rtf": ms / 1e3 / audio_s,
                    "audio_s": audio_s,
                    "first_partial_ms": None,
                    "first_text_ms": audio_s * 1e3 + ms,
                }
            )
    return rows


def summarize(rows: list[dict]) -> dict:
    from ..metrics.window import MetricSnapshot

    out = {}
    for metric in METRICS:
        snap = MetricSnapshot.of([r[metric] for r in rows if r[metric] is not None])
        out[metric] = {"p50": snap.p50, "p95": snap.p95, "p99": snap.p99, "mean": snap.mean, "count": snap.count}
    return out


def _median_rounds(rounds: list[dict]) -> dict:
    out: dict[str, dict[str, float | None]] = {}
    for metric in METRICS:
        out[metric] = {}
        for stat in ("p50", "p95", "p99", "mean", "count"):
            values = [r[metric][stat] for r in rounds if r[metric][stat] is not None]
            out[metric][stat] = statistics.median(values) if values else None
    return out


# -- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from ..backends import SessionOptions
    from ..config import load_settings
    from ..models.asr import open_recognizer
    from ..models.catalog import resolve_model
    from ..serving.asr.factory import make_service

    if args.streams < 1 or args.rounds < 1:
        raise InputError("--streams and --rounds must be at least 1")
    settings = load_settings(args.config)
    batching = settings.batching.model_copy(
        update={
            k: v
            for k, v in (("max_batch", args.max_batch), ("batch_timeout_ms", args.batch_timeout_ms))
            if v is not None
        }
    )
    if batching.max_batch < max(batching.preferred_batch_sizes, default=1):
        batching = batching.model_copy(
            update={"preferred_batch_sizes": [s for s in batching.preferred_batch_sizes if s <= batching.max_batch]}
        )
    ref = resolve_model(args.model or settings.models.asr[0].model, settings.models.cache_dir)
    device = "CPU" if args.backend == "openvino" else "cpu"
    engine = open_recognizer(
        ref, args.backend, SessionOptions(device=device, threads=args.threads), decoder=args.decoder
    )
    clips, audio_source = load_audio(args.audio)
    gap = np.zeros(int(0.3 * 16000), np.float32)
    audio = np.concatenate([c for clip in clips for c in (clip, gap)])
    stream_rounds: list[dict] = []
    base_rounds: list[dict] = []
    raw: dict[str, list[dict]] = {"streaming": [], "baseline": []}
    batch_sizes: dict[int, int] = {}
    same_text, compared = 0, 0
    try:
        service = make_service(engine, settings.audio, batching, streams=args.streams)
        segs = segments(engine, audio, service)
        engine.transcribe(segs[0] if segs else audio[:16000])  # warm-up
        for r in range(args.rounds):
            service = make_service(engine, settings.audio, batching, streams=args.streams).start()
            try:
                rows, _wall = run_streaming(service, audio, args.streams, SEED + r)
            finally:
                service.stop()
            for size, n in service.batcher.batch_sizes.items():
                batch_sizes[size] = batch_sizes.get(size, 0) + n
            base = run_baseline(engine, segs, args.streams)
            stream_rounds.append(summarize(rows))
            base_rounds.append(summarize(base))
            raw["streaming"] += rows
            raw["baseline"] += base
            texts = [b["text"] for b in base[: len(segs)]]
            for k in range(args.streams):
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
        "streams": args.streams,
        "rounds": args.rounds,
        "audio": audio_source,
        "utterances_per_stream": len(segs),
        "audio_s_per_stream": round(audio.size / 16000, 2),
        "batching": {
            "max_batch": batching.max_batch,
            "batch_timeout_ms": batching.batch_timeout_ms if args.streams > 1 else 0.0,
            "batches": total_batches,
            "sizes": dict(sorted(batch_sizes.items())),
            "mean_size": (sum(s * n for s, n in batch_sizes.items()) / total_batches) if total_batches else None,
        },
        "streaming": _median_rounds(stream_rounds),
        "baseline": _median_rounds(base_rounds),
        "final_text_equal_fraction": same_text / compared if compared else None,
        "notes": [
            "baseline: one non-streaming pass per utterance, sequential; final_ms = the pass",
            "first_text_ms: first voiced audio -> first text (baseline: utterance duration + pass)",
            "Whisper streams with LocalAgreement and a forced committed prefix: its final may differ "
            "from a one-pass decode; CTC finals equal it",
        ],
    }
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_report(report, raw, Path(args.plot))
    return 0


def _fmt(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def format_table(report: dict) -> str:
    s, b = report["streaming"], report["baseline"]
    lines = [
        f"ASR bench: {report['model']} ({report['kind']}) on {report['backend']} ({report['threads']} threads), "
        f"{report['streams']} stream(s) × {report['utterances_per_stream']} utterances × "
        f"{report['rounds']} rounds; "
        f"audio: {report['audio']}",
        f"{'metric (median of rounds)':<30}{'streaming':>12}{'one pass':>12}",
    ]
    for metric, digits in (("first_partial_ms", 1), ("first_text_ms", 1), ("final_ms", 1), ("rtf", 4)):
        for stat in ("p50", "p95"):
            streamed, one_pass = _fmt(s[metric][stat], digits), _fmt(b[metric][stat], digits)
            lines.append(f"{metric + ' ' + stat:<30}{streamed:>12}{one_pass:>12}")
    bt = report["batching"]
    lines.append(
        f"batches {bt['batches']} (mean size {_fmt(bt['mean_size'], 2)}, sizes {bt['sizes']}), "
        f"final text = one-pass text for {_fmt((report['final_text_equal_fraction'] or 0) * 100, 0)}% "
        "of utterances"
    )
    return "\n".join(lines)


def plot_report(report: dict, raw: dict, path: Path) -> Path:
    from .plot import cdf, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in (
        (axes[0], "final_ms", "End of speech → final"),
        (axes[1], "first_text_ms", "First voiced audio → first text"),
    ):
        for side, label in (("streaming", "streaming"), ("baseline", "one pass")):
            cdf(ax, [r[metric] for r in raw[side] if r[metric] is not None], label)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of utterances")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    values = [report["streaming"]["rtf"]["p50"] or 0, report["baseline"]["rtf"]["p50"] or 0]
    bars = axes[2].bar(["streaming", "one pass"], values, color=["tab:blue", "tab:orange"])
    axes[2].bar_label(bars, fmt="%.4f")
    axes[2].set_ylabel("RTF (p50)")
    axes[2].set_title(f"Real-time factor, {report['streams']} stream(s)")
    fig.suptitle(f"{report['model']} · {report['backend']} · {report['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
