"""``edge-agent bench asr --compare``: the fixed batching wait against the adaptive one, side by side.

Two service configurations on the same engine, the same audio and the same stream start offsets,
in alternating rounds (the order flips every round, so neither always runs on a warmer machine):

- **fixed** (the behaviour before the adaptive wait): a batch that is not full waits
  ``batch_timeout_ms`` for company (0 with one stream, as the factory sets it), an utterance's first
  step waits for a whole ``chunk_ms`` of audio, and a stateful streaming CTC step runs whole
  ``chunk_frames`` chunks only;
- **adaptive** (the default): the batch waits only for an expected batch-mate within the slack the
  first-partial SLA leaves (``serving/batch_wait.AdaptiveWait``), the first step goes at the speech
  start, and a step also runs the frames left over after its whole chunks.

For each stream count: first partial, first prefix of the final text, final latency and RTF, median
of the rounds, both columns and their ratio (fixed / adaptive: above 1 means the adaptive one is
faster), and whether each column's finals equal the one-pass text.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..serving.asr.service import AsrService
from .asr_replay import SEED, median_rounds, run_streaming, segments, setup, summarize
from .asr_report import fmt
from .options import AsrOptions

CONFIGS = ("fixed", "adaptive")
ROWS = (
    ("first_partial_ms", "p50", 1),
    ("first_partial_ms", "p95", 1),
    ("first_prefix_ms", "p50", 1),
    ("first_prefix_ms", "p95", 1),
    ("final_ms", "p50", 1),
    ("final_ms", "p95", 1),
    ("rtf", "p50", 4),
)


def make_config(base: AsrService, config: str, chunk_ms: int) -> AsrService:
    """A fresh service like ``base`` (endpointing, detector, limits) in the ``config`` flavour."""
    fixed = config == "fixed"
    engine: Any = base.engine  # a stateful streaming CTC engine has the chunk attributes
    if hasattr(engine, "min_chunk_frames"):  # stateful streaming CTC: whole chunks only, or the rest too
        engine.min_chunk_frames = engine.chunk_frames if fixed else engine.subsampling
    return AsrService(
        engine,
        limits=replace(base.batcher.limits, adaptive=not fixed),
        endpoint=base.endpoint,
        detector_factory=base.detector_factory,
        chunk_ms=chunk_ms,
        first_chunk_ms=None if fixed else 0,
        sla_ms=base.sla_ms,
    )


def run_compare(opts: AsrOptions) -> int:
    from ..serving.asr.factory import make_service

    settings, batching, ref, engine, audio, audio_source = setup(opts)
    report: dict = {
        "model": ref.name,
        "kind": engine.kind,
        "backend": opts.backend,
        "threads": opts.threads,
        "rounds": opts.rounds,
        "audio": audio_source,
        "batch_timeout_ms": batching.batch_timeout_ms,
        "chunk_ms": settings.audio.chunk_ms,
        "streams": {},
    }
    try:
        probe = make_service(engine, settings.audio, batching)
        segs = segments(engine, audio, probe)
        one_pass = [engine.transcribe(seg).text for seg in segs]  # also the warm-up
        for n in opts.streams:
            base = make_service(engine, settings.audio, batching, streams=n)
            rounds: dict[str, list[dict]] = {c: [] for c in CONFIGS}
            equal = dict.fromkeys(CONFIGS, 0)
            sizes: dict[str, list[float]] = {c: [] for c in CONFIGS}
            for r in range(opts.rounds):
                for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                    service = make_config(base, config, settings.audio.chunk_ms).start()
                    try:
                        rows, _wall = run_streaming(service, audio, n, SEED + r)
                    finally:
                        service.stop()
                    rounds[config].append(summarize(rows))
                    for k in range(n):
                        got = [row["text"] for row in rows[k * len(segs) : (k + 1) * len(segs)]]
                        equal[config] += sum(a == b for a, b in zip(got, one_pass)) if len(got) == len(segs) else 0
                    bs = service.batcher.batch_sizes
                    sizes[config].append(sum(s * c for s, c in bs.items()) / max(1, sum(bs.values())))
            total = opts.rounds * n * len(segs)
            report["streams"][str(n)] = {
                c: {
                    **median_rounds(rounds[c]),
                    "final_text_equal_fraction": equal[c] / total if total else None,
                    "mean_batch": statistics.median(sizes[c]),
                }
                for c in CONFIGS
            }
    finally:
        engine.close()
    print(format_compare(report))
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _ratio(fixed, adaptive) -> str:
    return "—" if fixed is None or not adaptive else f"{fixed / adaptive:.2f}×"


def format_compare(report: dict) -> str:
    lines = [
        f"ASR bench --compare: {report['model']} ({report['kind']}) on {report['backend']} "
        f"({report['threads']} threads), {report['rounds']} rounds each, alternating; audio: {report['audio']}; "
        f"chunk_ms {report['chunk_ms']}, batch_timeout_ms {report['batch_timeout_ms']:g} (fixed wait, "
        "adaptive bound; one stream: 0)",
    ]
    for n, cols in report["streams"].items():
        f, a = cols["fixed"], cols["adaptive"]
        lines.append(
            f"{n} stream(s): {'metric (median of rounds)':<26}{'fixed':>10}{'adaptive':>10}{'fixed/adapt':>13}"
        )
        for metric, stat, digits in ROWS:
            fv, av = f[metric][stat], a[metric][stat]
            label = f"{metric} {stat}"
            lines.append(f"{'':14}{label:<26}{fmt(fv, digits):>10}{fmt(av, digits):>10}{_ratio(fv, av):>13}")
        lines.append(f"{'':14}{'mean batch size':<26}{fmt(f['mean_batch'], 2):>10}{fmt(a['mean_batch'], 2):>10}")
        eq = [fmt((c["final_text_equal_fraction"] or 0) * 100, 0) + "%" for c in (f, a)]
        lines.append(f"{'':14}{'final = one-pass text':<26}{eq[0]:>10}{eq[1]:>10}")
    return "\n".join(lines)
