"""``edge-agent eval asr`` for Whisper models: WER per voice, with and without the words to expect.

    edge-agent eval asr --model whisper-base --data calibration/asr/voices-heldout.jsonl [--prompt WORDS]

Each utterance is recognised two ways by the agent's own recogniser (``models/asr_whisper.py``):

- ``full``: one 30 s pass, greedy (``transcribe``): what ``bench calls --speech`` and the upload API hear;
- ``stream``: the clip pushed in 100 ms blocks through a stream, a pass whenever the recogniser would make
  one (``min_step_s`` of new audio), then ended: its final. ``final_ms`` is the time from the end of the
  audio to the final text (the last pass over what was left: what a speaker waits for once the passes
  during speech kept up, as they do on the daemon when they fit in real time).

``--prompt`` (or a voice turn's tools, ``models/asr_prompt.py``) becomes each utterance's context
(Whisper's initial prompt). WER/CER are counted over all utterances and per voice (the manifest's ``voice``
label: ``piper joe ×0.85 n0.667``, ``flite slt``, ``espeak-ng en-us``), so every report says which voices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InputError
from ..metrics.window import percentile

if TYPE_CHECKING:
    from ..models.catalog import ModelRef
    from .asr_manifest import Utterance

MODES = ("full", "stream")
BLOCK = 1600  # samples pushed at a time (100 ms)


def evaluate_whisper(
    ref: ModelRef,
    data: Path,
    backend: str = "onnxruntime",
    device: str = "cpu",
    precision: str = "auto",
    threads: int = 1,
    limit: int | None = None,
    prompt: str = "",
    modes: tuple[str, ...] = MODES,
    progress=None,
    final_padding_s: float | None = None,
) -> dict:
    """Score the Whisper model ``ref`` on manifest ``data``; the report ``eval asr --json`` prints."""
    from ..backends import SessionOptions
    from ..models.asr import open_recognizer
    from .asr_manifest import read_manifest

    items = read_manifest(data)[:limit]
    options = SessionOptions(device=device, precision=precision, threads=threads)  # type: ignore[arg-type]
    extra = {} if final_padding_s is None else {"final_padding_s": final_padding_s}
    engine: Any = open_recognizer(ref, backend, options, **extra)  # a WhisperRecognizer: transcribe takes context
    rows: list[dict] = []
    timings = _Timings({m: [] for m in modes})
    try:
        for n, utt in enumerate(items, 1):
            rows.append(_recognise(engine, utt, data, modes, prompt, timings))
            if progress is not None:
                progress(n, len(items))
    finally:
        engine.close()
    results = {m: _rates(rows, m) for m in modes}
    voices = sorted({str(r["voice"]) for r in rows})
    per_voice = {v: {m: _rates([r for r in rows if r["voice"] == v], m) for m in modes} for v in voices}
    return {
        "model": ref.name,
        "model_path": str(ref.path),
        "data": str(data),
        "backend": backend,
        "device": device,
        "precision": precision,
        "threads": threads,
        "utterances": len(items),
        "audio_s": round(timings.audio_s, 2),
        "prompt": prompt,
        "final_padding_s": getattr(engine, "final_padding_s", None),
        "voices": voices,
        "results": results,
        "per_voice": per_voice,
        "latency": timings.summary(),
        "errors": [r for r in rows if any(r.get(m) != r["ref"] for m in modes)][:30],
    }


@dataclass
class _Timings:
    """Milliseconds per mode and utterance, the stream's end-of-audio-to-final (wall and CPU), audio seconds."""

    times: dict[str, list[float]]
    final_ms: list[float] = field(default_factory=list)
    final_cpu_ms: list[float] = field(default_factory=list)
    audio_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        times, final_ms, final_cpu_ms = self.times, self.final_ms, self.final_cpu_ms
        return {
            **{f"{m}_ms_p50": percentile(t, 50) for m, t in times.items() if t},
            **{f"{m}_ms_p95": percentile(t, 95) for m, t in times.items() if t},
            "final_ms_p50": percentile(final_ms, 50) if final_ms else None,
            "final_ms_p95": percentile(final_ms, 95) if final_ms else None,
            "final_cpu_ms_p50": percentile(final_cpu_ms, 50) if final_cpu_ms else None,
            "final_cpu_ms_p95": percentile(final_cpu_ms, 95) if final_cpu_ms else None,
            "rtf": sum(sum(t) for t in times.values()) / 1e3 / self.audio_s if self.audio_s else None,
        }


def _recognise(engine: Any, utt: Utterance, data: Path, modes: tuple[str, ...], prompt: str, timings: _Timings) -> dict:
    """One utterance recognised in each mode: its row (reference and texts); the times go to ``timings``."""
    from ..audio.wav import read_audio
    from ..metrics.wer import normalize

    try:
        samples, _ = read_audio(utt.audio, engine.sample_rate)
    except InputError as exc:
        raise InputError(f"{data}:{utt.line}: {exc}") from None
    timings.audio_s += samples.size / engine.sample_rate
    row = {"line": utt.line, "voice": utt.voice, "ref": normalize(utt.text)}
    if "full" in modes:
        t0 = time.perf_counter()
        row["full"] = engine.transcribe(samples, context=prompt).text
        timings.times["full"].append((time.perf_counter() - t0) * 1e3)
    if "stream" in modes:
        t0 = time.perf_counter()
        text, ms, cpu = stream_final(engine, samples, prompt)
        timings.final_cpu_ms.append(cpu)
        timings.times["stream"].append((time.perf_counter() - t0) * 1e3)
        row["stream"] = text
        timings.final_ms.append(ms)
    return row


def stream_final(engine, samples: np.ndarray, prompt: str = "") -> tuple[str, float, float]:
    """``samples`` through one stream in 100 ms blocks, a step after each, then ended: the final's text,
    the milliseconds from the end of the audio to it and the process CPU milliseconds that took (on a
    loaded machine the wall time waits for cores; the CPU time over the threads is what an idle one pays)."""
    stream = engine.new_stream()
    if prompt and hasattr(engine, "context_ids"):
        stream.context = engine.context_ids(prompt)
    for i in range(0, samples.size, BLOCK):
        stream.add_audio(samples[i : i + BLOCK])
        engine.step([stream])
    stream.end()
    t0, c0 = time.perf_counter(), time.process_time()
    text = ""
    for _ in range(8):
        hyp = engine.step([stream])[0]
        if hyp is not None and hyp.final:
            text = hyp.text
            break
    return text, (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def _rates(rows: list[dict], mode: str) -> dict:
    """WER and CER of ``mode`` over ``rows`` (hypotheses normalized in place), counted over all words."""
    from ..metrics.wer import align, normalize

    acc = {"words": [0, 0, 0, 0], "chars": [0, 0, 0, 0]}
    exact = 0
    for r in rows:
        hyp = r[mode] = normalize(r[mode])
        exact += hyp == r["ref"]
        for name, a, b in (("words", r["ref"].split(), hyp.split()), ("chars", list(r["ref"]), list(hyp))):
            c = align(a, b).counts
            for k, v in enumerate((c.ref_len, c.substitutions, c.deletions, c.insertions)):
                acc[name][k] += v
    out: dict[str, Any] = {}
    for name, (n, s, d, i) in acc.items():
        out["wer" if name == "words" else "cer"] = {
            "rate": (s + d + i) / n if n else 0.0,
            "ref_len": n,
            "substitutions": s,
            "deletions": d,
            "insertions": i,
        }
    out["exact"] = exact
    out["of"] = len(rows)
    return out


def format_whisper_report(report: dict) -> str:
    """The report as text: WER per mode, then per voice, then latency."""
    modes = list(report["results"])
    prompt = f"prompt {report['prompt']!r}" if report["prompt"] else "no prompt"
    head = (
        f"{report['model']} on {report['data']} ({report['utterances']} utterances, {report['audio_s']:.0f} s, "
        f"{report['backend']} {report['device']} {report['precision']}, {report['threads']} thread(s)); {prompt}"
    )
    lines = [head, f"voices: {', '.join(report['voices'])}"]
    lines.append(f"{'voice':<26}" + "".join(f"{m + ' WER %':>14}{'exact':>8}" for m in modes))
    rows = [("all", report["results"]), *report["per_voice"].items()]
    for name, res in rows:
        lines.append(
            f"{name or '(unnamed)':<26}"
            + "".join(f"{100 * res[m]['wer']['rate']:>14.2f}{res[m]['exact']:>4}/{res[m]['of']:<3}" for m in modes)
        )
    lat = report["latency"]
    parts = [f"{m} pass P50 {lat[f'{m}_ms_p50']:.0f} / P95 {lat[f'{m}_ms_p95']:.0f} ms" for m in modes]
    if lat.get("final_ms_p50") is not None:
        parts.append(
            f"end of audio → final P50 {lat['final_ms_p50']:.0f} / P95 {lat['final_ms_p95']:.0f} ms "
            f"(CPU {lat['final_cpu_ms_p50']:.0f} / {lat['final_cpu_ms_p95']:.0f} ms over {report['threads']} thread(s))"
        )
    lines.append("latency: " + "; ".join(parts))
    return "\n".join(lines)
