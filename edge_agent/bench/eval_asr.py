"""Word and character error rates of a speech model over a manifest (``edge-agent eval asr``, cli/eval.py).

    edge-agent eval asr --model demo-asr --data calibration/asr/heldout.jsonl [--json [OUT]]

The manifest is JSONL, one utterance a line: ``{"audio": "path relative to the manifest",
"text": "reference"}``. Each utterance is recognised streamed (100 ms audio chunks, the model's
state carried) and whole (one model call), decoded greedily and, where the model folder has a
``lexicon.txt`` (and ``lm.arpa``), with the lexicon-constrained beam search (and the n-gram
language model). ``service`` rows send each file through what the daemon runs: the serving
recogniser behind ``AsrService``, with the ``[audio]`` endpointing of the config (VAD, pre-roll),
100 ms pushes and the decoder the tier would use. WER/CER (``metrics/wer.py``) are reported for
each combination with the latency figures: real-time factor, compute per model call,
``final_ms`` (last audio pushed → final text: flush, last model call and decoding) and, with a beam
search, ``first_stable_ms``: how far into the clip the first word became stable (the part of a partial
the search will not take back: what a Wyoming ``transcript-chunk`` carries), the streamed log-probs fed a
frame at a time to the last decoder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError, ModelError
from ..metrics.window import percentile
from .asr_manifest import Utterance, read_manifest, voice_of

if TYPE_CHECKING:
    from ..backends import Precision
    from ..models.asr_streaming_ctc import Decoder, StreamingCtcRunner, StreamingCtcSpec
    from ..models.catalog import ModelRef

MODES = ("stream", "full", "service")
__all__ = ["MODES", "Utterance", "evaluate", "read_manifest", "voice_of"]


def evaluate(
    model: str,
    data: Path,
    backend: str = "onnxruntime",
    device: str = "cpu",
    precision: Precision = "auto",
    threads: int = 1,
    decoders: tuple[Decoder, ...] | None = None,
    limit: int | None = None,
    cache_dir: Path | None = None,
    audio=None,
    prompt: str = "",
    final_padding_s: float | None = None,
) -> dict:
    """Score ``model`` on manifest ``data``; the report ``edge-agent eval asr --json`` prints."""
    from ..backends import SessionOptions
    from ..models.asr_streaming_ctc import StreamingCtcRunner

    ref = _speech_model(model, cache_dir)
    if ref.kind == "asr-whisper":
        from .eval_whisper import evaluate_whisper

        return evaluate_whisper(
            ref, data, backend, device, precision, threads, limit, prompt=prompt, final_padding_s=final_padding_s
        )
    items = read_manifest(data)[:limit]
    options = SessionOptions(device=device, precision=precision, threads=threads)
    runner = StreamingCtcRunner(ref.path, backend, options)
    if decoders is None:
        decoders = _available_decoders(runner.spec)
    try:
        run = _run_direct(runner, data, items, decoders)
    finally:
        runner.close()
    for d in decoders:
        for out, hyp in zip(run.rows, _service_hyps(ref, backend, options, d, run.clips, audio)):
            out[f"service/{d}"] = hyp
    results = _error_rates(run.rows, decoders)
    wrong = [s for s in run.rows if s["ref"] != s.get(f"stream/{decoders[-1]}")]
    return {
        "model": ref.name,
        "model_path": str(ref.path),
        "data": str(data),
        "backend": backend,
        "device": device,
        "precision": precision,
        "threads": threads,
        "utterances": len(items),
        "audio_s": round(run.audio_s, 2),
        "results": results,
        "stream_vs_full_max_abs_diff": run.max_diff,
        "latency": _latency(run, runner.spec),
        "errors": wrong[:20],
    }


@dataclass(slots=True)
class _DirectRun:
    """What the runner's own passes over the manifest gave: one row per utterance (its line, the
    normalized reference and each ``stream/…`` and ``full/…`` hypothesis), the clips for the service
    pass, and the latency samples of the streamed pass."""

    rows: list[dict] = field(default_factory=list)
    clips: list[np.ndarray] = field(default_factory=list)
    audio_s: float = 0.0
    compute_s: float = 0.0
    chunk_ms: list[float] = field(default_factory=list)
    final_ms: list[float] = field(default_factory=list)
    first_stable_ms: list[float] = field(default_factory=list)
    max_diff: float = 0.0  # largest |streamed - whole| log-probability over all utterances


def _speech_model(model: str, cache_dir: Path | None) -> ModelRef:
    """The catalog's ``model``, refused unless eval asr scores its kind: a streaming CTC model or Whisper."""
    from ..models.catalog import resolve_model

    ref = resolve_model(model, cache_dir or Path.home() / ".cache" / "edge-agent" / "models")
    if ref.model_type != "streaming-ctc" and ref.kind != "asr-whisper":
        raise ModelError(
            f"{ref.name}: eval asr scores streaming CTC models (config.json model_type "
            f"'streaming-ctc') and Whisper models; this one is {ref.model_type!r}"
        )
    return ref


def _available_decoders(spec: StreamingCtcSpec) -> tuple[Decoder, ...]:
    """The decoders the model folder supports: greedy, the lexicon beam search with a ``lexicon.txt``,
    and the language model too with an ``lm.arpa`` beside it."""
    found: list[Decoder] = ["greedy"]
    if spec.lexicon is not None:
        found.append("lexicon")
        if spec.lm is not None:
            found.append("lm")
    return tuple(found)


def _run_direct(
    runner: StreamingCtcRunner, data: Path, items: list[Utterance], decoders: tuple[Decoder, ...]
) -> _DirectRun:
    """Each utterance through the runner itself, streamed (timed) and whole, decoded with every
    decoder both ways; a file that cannot be read names its manifest line."""
    from ..audio.wav import read_audio
    from ..metrics.wer import normalize

    rate = runner.spec.features.sampling_rate
    run = _DirectRun()
    for utt in items:
        try:
            samples, _ = read_audio(utt.audio, rate)
        except InputError as exc:
            raise InputError(f"{data}:{utt.line}: {exc}") from None
        run.audio_s += len(samples) / rate
        run.clips.append(samples)
        streamed, first = _stream_timed(runner, samples, decoders[0], run)
        whole = runner.full(samples)
        diff = float(np.max(np.abs(whole - streamed))) if whole.shape == streamed.shape else float("inf")
        run.max_diff = max(run.max_diff, diff)
        hyps = {f"stream/{decoders[0]}": first}
        if decoders[-1] != "greedy":  # the streamed decode a frame at a time: its text and first stable word
            text, first_stable = _stable_pass(runner, streamed, decoders[-1])
            hyps.setdefault(f"stream/{decoders[-1]}", text)
            run.first_stable_ms.append(first_stable)
        for d in decoders:
            for mode, lp in (("stream", streamed), ("full", whole)):
                key = f"{mode}/{d}"
                if key not in hyps:
                    hyps[key] = runner.decode(lp, d)
        run.rows.append({"line": utt.line, "ref": normalize(utt.text), **hyps})
    return run


def _stable_pass(runner: StreamingCtcRunner, log_probs: np.ndarray, decoder: Decoder) -> tuple[str, float]:
    """The search fed a frame at a time: its final text, and how far into the clip (ms of audio) its first
    stable word came (the clip's length when nothing was stable before its end)."""
    spec = runner.spec
    frame_ms = spec.subsampling * spec.features.hop_length * 1000 / spec.features.sampling_rate
    search, first = runner.search(decoder), None
    for i in range(len(log_probs)):
        search.advance(log_probs[i : i + 1])
        if first is None and search.stable_ids:
            first = (i + 1) * frame_ms
    search.finish()
    return runner.text(list(search.ids)), first if first is not None else len(log_probs) * frame_ms


def _stream_timed(
    runner: StreamingCtcRunner, samples: np.ndarray, decoder: Decoder, run: _DirectRun
) -> tuple[np.ndarray, str]:
    """One clip streamed in 1600-sample pushes, flushed and decoded with ``decoder``: its log
    probabilities and text. Its compute time, ``final_ms`` (last push → text) and the compute of each
    model call go to ``run``."""
    t0 = time.perf_counter()
    stream = runner.start()
    for i in range(0, len(samples), 1600):
        runner.push(stream, samples[i : i + 1600])
    t_last = time.perf_counter()
    streamed = runner.finish(stream)
    text = runner.decode(streamed, decoder)
    run.final_ms.append((time.perf_counter() - t_last) * 1e3)
    run.compute_s += time.perf_counter() - t0
    run.chunk_ms.extend(stream.chunk_ms)
    return streamed, text


def _error_rates(rows: list[dict], decoders: tuple[Decoder, ...]) -> dict:
    """WER and CER of each mode and decoder, counted over all utterances (not averaged per
    utterance). Each row's hypotheses are normalized in place, as the report's ``errors`` show them."""
    from ..metrics.wer import align, normalize

    totals = {f"{m}/{d}": {"words": [0, 0, 0, 0], "chars": [0, 0, 0, 0]} for m in MODES for d in decoders}
    for out in rows:
        ref_n = out["ref"]
        for key in totals:
            hyp_n = out[key] = normalize(out[key])
            w, c = align(ref_n.split(), hyp_n.split()).counts, align(list(ref_n), list(hyp_n)).counts
            for name, counts in (("words", w), ("chars", c)):
                acc = totals[key][name]
                acc[0] += counts.ref_len
                acc[1] += counts.substitutions
                acc[2] += counts.deletions
                acc[3] += counts.insertions
    return {key: {"wer": _rates(v["words"]), "cer": _rates(v["chars"])} for key, v in totals.items()}


def _rates(acc: list[int]) -> dict:
    """One error rate from its summed [reference length, substitutions, deletions, insertions]."""
    n, s, d, i = acc
    return {
        "rate": (s + d + i) / n if n else 0.0,
        "ref_len": n,
        "substitutions": s,
        "deletions": d,
        "insertions": i,
    }


def _latency(run: _DirectRun, spec: StreamingCtcSpec) -> dict:
    """The streamed pass's latency figures: real-time factor, the audio per model call, the compute
    per model call, ``final_ms`` and ``first_stable_ms`` (P50 and P95; None with greedy decoding only)."""
    return {
        "rtf": run.compute_s / run.audio_s if run.audio_s else None,
        "chunk_ms": spec.chunk_frames * spec.features.hop_length * 1000 / spec.features.sampling_rate,
        "compute_per_chunk_ms_p50": percentile(run.chunk_ms, 50),
        "compute_per_chunk_ms_p95": percentile(run.chunk_ms, 95),
        "final_ms_p50": percentile(run.final_ms, 50),
        "final_ms_p95": percentile(run.final_ms, 95),
        "first_stable_ms_p50": percentile(run.first_stable_ms, 50) if run.first_stable_ms else None,
        "first_stable_ms_p95": percentile(run.first_stable_ms, 95) if run.first_stable_ms else None,
        "count": len(run.final_ms),
    }


def _service_hyps(ref, backend: str, options, decoder: str, clips: list[np.ndarray], audio) -> list[str]:
    """Each clip through the daemon's path: serving recogniser + AsrService (endpointing, 100 ms pushes)."""
    from ..config import AudioConfig, BatchingConfig
    from ..models.asr import open_recognizer
    from ..serving.asr.factory import feed_lockstep, make_service

    engine = open_recognizer(ref, backend, options, decoder=decoder)
    service = make_service(engine, audio or AudioConfig(), BatchingConfig()).start()
    hyps = []
    try:
        for samples in clips:
            stream = service.open_stream()
            feed_lockstep(stream, samples, 1600)
            stream.wait(120)
            hyps.append(" ".join(e.text for e in stream.finals if e.text))
    finally:
        service.stop()
        engine.close()
    return hyps
