"""The replay under ``edge-agent bench asr``: speech to replay, one streaming round through an
``AsrService`` (real-time streams, per-utterance metrics), one one-pass round, and their summaries.
``bench/asr.py`` (the command) and ``bench/asr_compare.py`` (``--compare``) both run rounds with it."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .options import AsrOptions

SENTENCES = ("turn on the kitchen lights", "what is the weather like tomorrow morning", "set a timer for ten minutes")
SEED = 1234
METRICS = ("first_partial_ms", "first_prefix_ms", "final_ms", "first_text_ms", "rtf")


# -- audio ------------------------------------------------------------------------------------


def _synthetic(seconds: float, seed: int) -> np.ndarray:
    """TieredSpeech-like: voiced harmonic bursts (syllables) with pitch drift, under 60 ms gaps."""
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
    partials: list[list] = [[] for _ in range(streams)]
    block = 320

    def client(k: int) -> None:
        handle = service.open_stream(lambda e: partials[k].append(e) if e.kind == "partial" else None)
        time.sleep(float(offsets[k]))
        start = time.monotonic()
        for i in range(0, len(audio), block):
            handle.feed(audio[i : i + block])
            delay = start + (i + block) / 16000 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        handle.close()
        handle.wait(120)
        results[k] = [(f, [p for p in partials[k] if p.utterance == f.utterance]) for f in handle.finals]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    rows = []
    for finals in results:
        for f, seen in finals:
            m = f.metrics
            rows.append(
                {
                    "text": f.text,
                    "first_partial_ms": m.first_partial_ms,
                    "first_prefix_ms": _first_prefix_ms(f, seen),
                    "final_ms": m.final_ms,
                    "rtf": m.rtf,
                    "audio_s": m.audio_s,
                    "first_text_ms": m.first_partial_ms
                    if m.first_partial_ms is not None
                    else m.audio_s * 1e3 + m.final_ms,
                }
            )
    return rows, wall


def _first_prefix_ms(final, partials) -> float | None:
    """First voiced audio → the first partial whose text begins the final text (None: no such partial)."""
    if not partials or final.metrics.first_partial_ms is None:
        return None
    voiced_at = partials[0].at_s - final.metrics.first_partial_ms / 1e3  # the first partial's own metric
    for p in partials:
        if p.text and final.text.startswith(p.text):
            return (p.at_s - voiced_at) * 1e3
    return None


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
                    "first_prefix_ms": None,
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


def median_rounds(rounds: list[dict]) -> dict:
    out: dict[str, dict[str, float | None]] = {}
    for metric in METRICS:
        out[metric] = {}
        for stat in ("p50", "p95", "p99", "mean", "count"):
            values = [r[metric][stat] for r in rounds if r[metric][stat] is not None]
            out[metric][stat] = statistics.median(values) if values else None
    return out


def setup(opts: AsrOptions):
    """Settings, batching config (with the command's overrides), model, open engine, replayed audio."""
    from ..backends import SessionOptions
    from ..config import load_settings
    from ..models.asr import open_recognizer
    from ..models.catalog import resolve_model

    settings = load_settings(opts.config)
    batching = settings.batching.model_copy(
        update={
            k: v
            for k, v in (("max_batch", opts.max_batch), ("batch_timeout_ms", opts.batch_timeout_ms))
            if v is not None
        }
    )
    if batching.max_batch < max(batching.preferred_batch_sizes, default=1):
        batching = batching.model_copy(
            update={"preferred_batch_sizes": [s for s in batching.preferred_batch_sizes if s <= batching.max_batch]}
        )
    ref = resolve_model(opts.model or settings.models.asr[0].model, settings.models.cache_dir)
    device = "CPU" if opts.backend == "openvino" else "cpu"
    engine = open_recognizer(
        ref, opts.backend, SessionOptions(device=device, threads=opts.threads), decoder=opts.decoder
    )
    try:
        clips, audio_source = load_audio(opts.audio)
    except BaseException:
        engine.close()
        raise
    gap = np.zeros(int(0.3 * 16000), np.float32)
    audio = np.concatenate([c for clip in clips for c in (clip, gap)])
    return settings, batching, ref, engine, audio, audio_source
