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

import json
from pathlib import Path

from ..errors import InputError
from .asr_replay import SEED, median_rounds, run_baseline, run_streaming, segments, setup, summarize
from .options import AsrOptions

# -- the command --------------------------------------------------------------------------------


def run(opts: AsrOptions) -> int:
    """Measure streaming against one-pass decoding (or, with ``compare``, the two batching waits); print the table."""
    from ..serving.asr.factory import make_service

    if opts.rounds < 1:
        raise InputError("--rounds must be at least 1")
    if opts.compare:
        from .asr_compare import run_compare

        return run_compare(opts)
    if len(opts.streams) != 1:
        raise InputError(f"--streams {opts.streams}: one count, or a list with --compare")
    streams = opts.streams[0]
    settings, batching, ref, engine, audio, audio_source = setup(opts)
    stream_rounds: list[dict] = []
    base_rounds: list[dict] = []
    raw: dict[str, list[dict]] = {"streaming": [], "baseline": []}
    batch_sizes: dict[int, int] = {}
    same_text, compared = 0, 0
    try:
        service = make_service(engine, settings.audio, batching, streams=streams)
        segs = segments(engine, audio, service)
        engine.transcribe(segs[0] if segs else audio[:16000])  # warm-up
        for r in range(opts.rounds):
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
        "backend": opts.backend,
        "threads": opts.threads,
        "streams": streams,
        "rounds": opts.rounds,
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
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if opts.plot:
        plot_report(report, raw, Path(opts.plot))
    return 0
