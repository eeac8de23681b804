"""End of speech → final transcript of a streamed Whisper, per spoken command, on a machine others share.

    .venv/bin/python scripts/whisper_final_latency.py [--model whisper-base[,FOLDER...]] [--data MANIFEST] [--limit 93]
        [--max-audio-s 5] [--padding S[,S...]] [--repeats 3] [--threads 2] [--prompt WORDS | --no-prompt] [--json OUT]

Each clip goes through one stream in 100 ms blocks with a step after each (a pass whenever the recogniser
makes one, as ``eval asr``'s stream mode does), then the final step is timed ``--repeats`` + 1 times: on
``--repeats`` forks of the stream (``WhisperStream.fork``: its audio, context and last tokens; a final
decodes free of the commits, so a fork's final is the stream's own), then on the stream itself. Its
final must equal the one pass over the same window (``transcribe``), which the script checks. Per clip the
fastest run is kept (what the machine gives when nobody else runs: other jobs only add time), and the
report gives P50 / P95 over the clips of that, of the median run, and the process CPU time of the fastest.
Default: the 31 home commands of the natural-voice set (the first 93 lines, each said by 3 voices), the
home tools' words as context, the final window of ``[asr] final_padding_s``. Several ``--padding`` values
run clip by clip in turn (the order rotating), so the machine's other load falls on each alike; so do
several ``--model`` (names or folders: a model and an engine built from it, side by side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_agent.audio.wav import read_audio  # noqa: E402
from edge_agent.backends import SessionOptions  # noqa: E402
from edge_agent.bench.asr_manifest import read_manifest  # noqa: E402
from edge_agent.config import load_settings  # noqa: E402
from edge_agent.metrics.window import percentile  # noqa: E402
from edge_agent.models.asr import open_recognizer  # noqa: E402
from edge_agent.models.asr_prompt import build_prompt  # noqa: E402
from edge_agent.models.catalog import resolve_model  # noqa: E402

BLOCK = 1600  # 100 ms
HOME_TOOLS = ROOT / "edge_agent" / "demo_models" / "home-tools.json"


def timed_final(engine, stream) -> tuple[float, float, object]:
    stream.end()
    t0, c0 = time.perf_counter(), time.process_time()
    hyp = None
    while hyp is None or not hyp.final:
        hyp = engine.step([stream])[0]
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3, hyp


def measure(engine, x: np.ndarray, words: str, repeats: int) -> dict:
    """One clip streamed, its final timed ``repeats`` + 1 times (forks, then the stream), checked against the
    one pass over the same window."""
    s = engine.new_stream()
    s.context = engine.context_ids(words)
    for i in range(0, x.size, BLOCK):
        s.add_audio(x[i : i + BLOCK])
        engine.step([s])
    runs = [timed_final(engine, s.fork()) for _ in range(repeats)] + [timed_final(engine, s)]
    one_pass = engine.transcribe(x, context=words)
    texts = {h.text for _, _, h in runs}
    assert texts == {one_pass.text}, (texts, one_pass.text)
    wall = sorted(r[0] for r in runs)
    best = min(runs, key=lambda r: r[0])
    return {"heard": one_pass.text, "wall_ms": wall, "best_ms": wall[0], "median_ms": float(np.median(wall)),
            "best_cpu_ms": best[1]}  # fmt: skip


def summary(rows: list[dict]) -> dict:
    return {
        f"{k}_p{q}": round(percentile([r[k] for r in rows], q), 1)
        for k in ("best_ms", "median_ms", "best_cpu_ms")
        for q in (50, 95)
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--data", default=str(ROOT / "calibration" / "asr" / "voices-heldout.jsonl"))
    p.add_argument("--limit", type=int, default=93)
    p.add_argument("--max-audio-s", type=float, default=5.0, help="commands up to this long (speech, lead and tail)")
    p.add_argument("--padding", default=None, help="final_padding_s, or several: 6,5,4 (default: [asr]'s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", default=None, help="context words (default: the home tools' words)")
    p.add_argument("--no-prompt", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    settings = load_settings(None)
    paddings = [settings.asr.final_padding_s] if args.padding is None else [float(v) for v in args.padding.split(",")]
    words = "" if args.no_prompt else args.prompt or build_prompt(json.loads(HOME_TOOLS.read_text())["tools"])
    models = args.model.split(",")
    engines = []
    try:
        for name in models:
            ref = resolve_model(name, settings.models.cache_dir)
            options = SessionOptions(threads=args.threads)
            engines.append(open_recognizer(ref, "onnxruntime", options, final_padding_s=paddings[0]))
        runs = [(m, p) for m in range(len(models)) for p in paddings]
        rows: dict[tuple[int, float], list[dict]] = {run: [] for run in runs}
        for n, utt in enumerate(read_manifest(Path(args.data))[: args.limit]):
            x, _ = read_audio(utt.audio, engines[0].sample_rate)
            if x.size > args.max_audio_s * engines[0].sample_rate:
                continue
            for k in range(len(runs)):
                m, padding = runs[(n + k) % len(runs)]
                engines[m].final_padding_s = padding
                row = {"text": utt.text, "voice": utt.voice, "audio_s": x.size / engines[m].sample_rate}
                rows[m, padding].append(row | measure(engines[m], x, words, args.repeats))
    finally:
        for engine in engines:
            engine.close()
    report: dict = {"models": models, "threads": args.threads, "prompt": words, "results": {}}
    for (m, padding), got in rows.items():
        key = f"{models[m]} {padding:g}" if len(models) > 1 else str(padding)
        report["results"][key] = {
            "model": models[m], "final_padding_s": padding, "clips": len(got), **summary(got), "rows": got
        }  # fmt: skip
        r = report["results"][key]
        print(
            f"{models[m]}, final window audio + {padding:g} s, {args.threads} threads, {len(got)} clips <= "
            f"{args.max_audio_s:g} s: end of speech -> final, fastest of {args.repeats + 1} P50 / P95 "
            f"{r['best_ms_p50']:.0f} / {r['best_ms_p95']:.0f} ms (median run {r['median_ms_p50']:.0f} / "
            f"{r['median_ms_p95']:.0f} ms; CPU {r['best_cpu_ms_p50']:.0f} / {r['best_cpu_ms_p95']:.0f} ms)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
