"""``edge-agent bench tiers --workload asr``: the ASR tier controller under a rising, holding and falling load.

Poisson arrivals of spoken-command streams (espeak-ng WAVs synthesised at start, several voices),
each paced in real time (100 ms of PCM16 every 100 ms), run twice in one process on the same seeded
arrival times: once on the ASR ladder (``serving.asr.tiers.TieredSpeech`` + ``TierController``, heavy
``demo-whisper`` above light streaming ``demo-asr``), once on the fixed heavy tier. The metric is each
utterance's ``first_partial_ms`` (P95 against ``[sla.asr]``'s target unless ``--target-ms``).
Reported: a timeline, every switch with its reason, streams started/finished/failed (must be 0 failed:
a stream that raises, gets an ``error`` event or no final counts as failed), shed streams, and the time
over target, adaptive vs. fixed.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import InputError, Unavailable
from ..metrics.window import percentile
from ..progress import Progress
from ..serving.tiers.control import TierController
from ..serving.tiers.policy import knobs, policy_from_config
from . import ramp
from .options import TiersOptions
from .ramp import arrivals, rate_at, table_lines, timeline

DEFAULT_TIERS = "demo-whisper,demo-asr"
METRIC = "first_partial_ms"
CHUNK_S = 0.1  # 100 ms of PCM16 per push, one push every 100 ms
RATE = 16_000


def _settings(names: Sequence[str], threads: int):
    from ..config import AsrTierConfig, load_settings

    s = load_settings(None)
    tiers = [AsrTierConfig(name=n, model=n) for n in names]
    return s.model_copy(
        update={
            "models": s.models.model_copy(update={"asr": tiers}),
            "device": s.device.model_copy(update={"threads": threads}),
        }
    )


def _clips(workdir: Path) -> list[tuple[bytes, str]]:
    from ..audio.spoken import synthesize
    from ..audio.wav import read_audio

    made = synthesize(workdir)
    if not made:
        raise InputError("bench tiers --workload asr needs espeak-ng and sox to synthesise its spoken commands")
    out = []
    for path, text in made:
        samples, _ = read_audio(path, RATE)
        out.append(((np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes(), text))
    return out


def _feed(stream, pcm: bytes) -> None:
    step = int(RATE * CHUNK_S) * 2
    t0 = time.monotonic()
    for k, offset in enumerate(range(0, len(pcm), step)):
        delay = t0 + k * CHUNK_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        stream.push(pcm[offset : offset + step])
    stream.close()


def _drive(speech, schedule: Sequence[float], clips: Sequence[tuple[bytes, str]], label: str, show: bool) -> dict:
    lock = threading.Lock()
    rows: list[dict] = []
    errors: list[str] = []
    streams: list[dict] = []
    threads: list[threading.Thread] = []

    def one(k: int, offset: float, stream, events: list[dict]) -> None:
        error = None
        try:
            _feed(stream, clips[k % len(clips)][0])
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finals = [e for e in events if e["kind"] == "final"]
        bad = [e.get("error", "error event") for e in events if e["kind"] == "error"]
        if error is None and (bad or not finals):
            error = bad[0] if bad else "no final transcript"
        tier = stream.owner.tier.name
        with lock:
            streams.append({"stream": k, "t_s": offset, "tier": tier, "finals": len(finals), "error": error})
            if error is not None:
                errors.append(f"stream {k}: {error}")
            for e in finals:
                rows.append(
                    {
                        "t_s": offset,
                        "stream": k,
                        "tier": tier,
                        "first_partial_ms": e.get("first_partial_ms"),
                        "final_ms": e.get("final_ms"),
                        "text": e.get("text", ""),
                    }
                )

    shed: list[float] = []
    start = time.monotonic()
    with Progress(label, "stream", enabled=show) as bar:
        for k, offset in enumerate(schedule):
            delay = start + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            events: list[dict] = []
            try:
                stream = speech.open_stream(events.append)
            except Unavailable:
                shed.append(offset)
                continue
            thread = threading.Thread(target=one, args=(k, offset, stream, events), daemon=True)
            thread.start()
            threads.append(thread)
            bar.update(k + 1, len(schedule))
    for thread in threads:
        thread.join(180)
    hung = sum(t.is_alive() for t in threads)
    if hung:
        errors.append(f"{hung} stream(s) did not finish within 180 s")
    streams.sort(key=lambda s: s["stream"])
    errored = sum(s["error"] is not None for s in streams)
    return {
        "streams": len(schedule),
        "started": len(threads),
        "finished": len(streams) - errored,
        "failed": errored + hung,
        "shed": len(shed),
        "errors": errors[:5],
        "rows": sorted(rows, key=lambda r: r["t_s"]),
        "stream_log": streams,
        "shed_at": shed,
        "wall_s": time.monotonic() - start,
    }


def _summary(run: dict, over_s: float) -> dict:
    fp = [r["first_partial_ms"] for r in run["rows"] if r["first_partial_ms"] is not None]
    by_tier: dict[str, int] = {}
    for r in run["rows"]:
        by_tier[r["tier"]] = by_tier.get(r["tier"], 0) + 1
    return {k: run[k] for k in ("streams", "started", "finished", "failed", "shed", "errors")} | {
        "utterances": len(run["rows"]),
        "first_partial_p50_ms": percentile(fp, 50),
        "first_partial_p95_ms": percentile(fp, 95),
        "first_partial_p99_ms": percentile(fp, 99),
        "time_over_target_s": over_s,
        "served_by_tier": by_tier,
    }


def run(opts: TiersOptions) -> int:
    """The ASR ladder against its fixed heavy tier on the same arrivals; 1 when a stream failed."""
    names, duration, base, peak = _checked(opts)
    settings = _settings(names, opts.threads)
    target = opts.target_ms or settings.sla.asr.target_ms
    show = not opts.quiet
    with tempfile.TemporaryDirectory(prefix="edge-agent-asr-bench-") as tmp:
        clips = _clips(Path(tmp))
    schedule = arrivals(duration, base, peak, opts.seed)

    ev = opts.evaluate_every_s
    policy = replace(
        policy_from_config(settings.sla.asr),
        target_ms=target,
        min_samples=4,
        downgrade_after=2,
        upgrade_after=3,
        cooldown_s=8 * ev,
        min_dwell_s=2 * ev,
    )  # short, as the LLM bench
    adaptive, events = _adaptive_run(settings, names, policy, opts, schedule, clips, show)
    fixed = _fixed_run(names, opts.threads, schedule, clips, show)

    bucket_s = max(2.0, duration / 15)
    tl_a, over_a = timeline(adaptive, duration, bucket_s, target, METRIC)
    tl_f, over_f = timeline(fixed, duration, bucket_s, target, METRIC)
    report = {
        "workload": "asr",
        "metric": METRIC,
        "tiers": names,
        "threads": opts.threads,
        "duration_s": duration,
        "target_ms": target,
        "base_rate": base,
        "peak_rate": peak,
        "streams": len(schedule),
        "arrivals": [round(t, 4) for t in schedule],
        "clips": [{"text": text, "audio_s": len(pcm) / 2 / RATE} for pcm, text in clips],
        "policy": knobs(policy),
        "window_s": opts.window_s,
        "evaluate_every_s": ev,
        "adaptive": _summary(adaptive, over_a),
        "fixed": _summary(fixed, over_f),
        "over_target_ratio": (over_a / over_f) if over_f else None,
        "switches": [{"t_s": round(t, 2), **p} for t, k, p in events if k == "tier_switch"],
        "events": [{"t_s": round(t, 2), "kind": k, **p} for t, k, p in events],
        "timeline": _timeline_rows(tl_a, tl_f, bucket_s, duration, base, peak),
        "raw": {"adaptive": adaptive["rows"], "fixed": fixed["rows"]},
        "stream_log": {"adaptive": adaptive["stream_log"], "fixed": fixed["stream_log"]},
        "shed_at": {"adaptive": adaptive["shed_at"], "fixed": fixed["shed_at"]},
    }
    print(format_report(report))
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if opts.plot:
        plot_tiers(report, Path(opts.plot))
    return 1 if adaptive["failed"] or fixed["failed"] else 0


def _checked(opts: TiersOptions) -> tuple[list[str], float, float, float]:
    """The tier names (heaviest first), duration and base and peak rates, each checked."""
    names = [n.strip() for n in (opts.tiers or DEFAULT_TIERS).split(",") if n.strip()]
    if len(names) < 2:
        raise InputError("--tiers needs at least two ASR models, heaviest first")
    duration = 35.0 if opts.duration_s is None else opts.duration_s
    if duration < 10:
        raise InputError(f"--duration-s must be at least 10, got {duration}")
    base = opts.base_rate or 0.3
    peak = opts.peak_rate or 1.5
    if not 0 < base <= peak:
        raise InputError(f"need 0 < --base-rate ({base:g}) <= --peak-rate ({peak:g})")
    return names, duration, base, peak


def _adaptive_run(
    settings, names: list[str], policy, opts: TiersOptions, schedule: list[float], clips: list, show: bool
) -> tuple[dict, list[tuple[float, str, dict]]]:
    """The arrivals on the ASR ladder under the tier controller; the run and the controller's events
    (seconds since the controller started, kind, payload)."""
    from ..serving.asr.tiers import open_speech

    events: list[tuple[float, str, dict]] = []
    holder: dict = {}
    t0 = [time.monotonic()]

    def note(kind: str, payload: dict) -> None:
        events.append((time.monotonic() - t0[0], kind, payload))

    def utterance(obs) -> None:
        if "c" in holder:
            holder["c"].observe(obs)

    def switched(old: int, new: int, ms: float, err: str | None) -> None:
        note("loaded", {"to": names[new], "load_ms": ms, "error": err})
        if err and "c" in holder:
            holder["c"].switch_failed(old, new, err)

    speech = open_speech(settings, observe=utterance, on_switched=switched, drain_s=60.0)
    controller = holder["c"] = TierController(
        speech, policy, window_s=opts.window_s, evaluate_every_s=opts.evaluate_every_s, on_event=note, workload="asr"
    )
    t0[0] = time.monotonic()
    controller.start()
    try:
        adaptive = _drive(speech, schedule, clips, "adaptive run", show)
    finally:
        controller.stop()
        speech.stop(60.0)
    return adaptive, events


def _fixed_run(names: list[str], threads: int, schedule: list[float], clips: list, show: bool) -> dict:
    """The same arrivals on the heaviest tier alone."""
    from ..serving.asr.tiers import open_speech

    fixed_speech = open_speech(_settings(names[:1], threads), drain_s=60.0)
    try:
        return _drive(fixed_speech, schedule, clips, "fixed heavy tier", show)
    finally:
        fixed_speech.stop(60.0)


def _timeline_rows(tl_a: list, tl_f: list, bucket_s: float, duration: float, base: float, peak: float) -> list[dict]:
    """Per bucket: the offered rate, the ladder's tier, both arms' first-partial P95."""
    return [
        {
            "t_s": a["t_s"],
            "rate": rate_at(a["t_s"] + bucket_s / 2, duration, base, peak),
            "tier": a["tier"],
            "adaptive_first_partial_p95_ms": a["first_partial_p95_ms"],
            "fixed_first_partial_p95_ms": f["first_partial_p95_ms"],
        }
        for a, f in zip(tl_a, tl_f)
    ]


def format_report(r: dict) -> str:
    head = (
        f"ASR tier bench: {' > '.join(r['tiers'])}, {r['duration_s']:g} s, Poisson {r['base_rate']:.2f} → "
        f"{r['peak_rate']:.2f} → {r['base_rate']:.2f} streams/s ({r['streams']} streams, real-time paced), "
        f"target first_partial P95 ≤ {r['target_ms']:g} ms"
    )
    keys = (
        "started",
        "finished",
        "failed",
        "shed",
        "first_partial_p50_ms",
        "first_partial_p95_ms",
        "first_partial_p99_ms",
        "time_over_target_s",
    )
    lines = [head, *table_lines(r, METRIC, "fixed heavy", keys)]
    for side in ("adaptive", "fixed"):
        lines.extend(f"{side} error: {e}" for e in r[side]["errors"])
    return "\n".join(lines)


def plot_tiers(r: dict, path: Path) -> Path:
    return ramp.plot_tiers(
        r,
        path,
        metric=METRIC,
        label="first partial",
        unit="streams/s",
        title="ASR tier controller vs fixed heavy tier",
        count="streams",
    )
