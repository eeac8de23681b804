"""Whisper engines: a Whisper folder's three graphs built at one precision into one engine folder.

Whisper is an encoder, a first-step decoder and a decoder with past (``models/asr_whisper.py``); a
recipe names them in ``graphs``. Each graph is converted at the build's precision and optimized on
its own, into ``staging/<key>/model/`` beside the source folder's config, tokenizer and preprocessor
files, so the engine opens wherever a Whisper folder does (a tier's ``model`` may name it).

The gate judges an engine by what a user hears back: ``WhisperProbe`` runs the agent's own recogniser
(``WhisperRecognizer.transcribe``: one 30 s pass, greedy, the serving suppression rules) on the
held-out utterances with the FP32 source and with the candidate, and ``gate.asr_metrics`` scores both
transcripts by WER against the references.

Precisions (ONNX Runtime): ``fp32`` (the export, optimized), ``fp16`` (float16 weights and compute,
float32 inputs and outputs), ``int8`` (dynamic: int8 per-channel MatMul/Gemm weights, activations
scaled per call, no calibration set; the convolutions stay float: ONNX Runtime's integer Conv is
slower than its float one on CPUs), ``int8w`` (weight-only MatMulNBits, 8 bits per block, the
recipe's ``[weight_only]``). A recipe's ``float_graphs`` stay FP32 at every precision (an INT8 engine of
the encoder alone, Whisper's decoders as exported).

With ``[dynamic] max_state_error`` the INT8 encoder keeps its costliest matmuls FP32 (``keep_float``): each
weight matmul is left FP32 alone once and ranked by how far the rest's INT8 states then are from FP32's on
the recipe's calibration audio; they are kept FP32 in that order until the states are within the budget.
Whisper base's encoder has a few matmuls that cost most of its INT8 error (one block's second FFN
matmul and the first block's projections), so a handful kept FP32 buys most of the accuracy back for a
fraction of the speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends import SessionOptions
from ..errors import InputError, ModelError
from ..models.catalog import ModelRef, inspect_folder
from . import quantize_ort
from .datasets import AudioSample
from .recipes import WEIGHT_ONLY

if TYPE_CHECKING:
    from ..models.asr_whisper import WhisperRecognizer
    from .model_io import Timed
    from .stages import StageContext

Progress = Callable[[int, int], None]
WHISPER_INT8_OPS = ["MatMul", "Gemm"]


def convert(ctx: StageContext, staged: Path, parts: dict[str, Any], calibration: Callable[[], Path]) -> dict:
    """Each graph at the build's precision into ``staged/work`` (FP32: left as exported); ``calibration``: the
    build's calibration manifest (``[dynamic]``'s audio), asked for only when the pass runs."""
    backend, precision, flavour = parts["backend"], parts["precision"], parts["flavour"]
    if backend != "onnxruntime":
        raise InputError(
            f"{ctx.recipe.name}: a multi-graph (Whisper) engine builds for ONNX Runtime here, not {backend}"
        )
    if precision == "int8" and flavour != "dynamic":
        raise InputError(f"{ctx.recipe.name}: Whisper INT8 engines are dynamic (flavour 'dynamic'), not {flavour!r}")
    work = staged / "work"
    work.mkdir(exist_ok=True)
    quantize_ort.copy_sidecars(ctx.ref.path, staged / "model", ctx.recipe.graphs[0])
    t0 = time.perf_counter()
    done: dict[str, Any] = {}
    with ctx.hb.bar(f"converting to {precision}", "graphs") as bar:
        for i, name in enumerate(ctx.recipe.graphs):
            ctx.hb.check()
            src, dst = ctx.ref.path / name, work / name
            if precision == "fp32":
                done[name] = {"tool": "none (the FP32 export)"}
            elif name in ctx.recipe.float_graphs:
                done[name] = {"tool": "none (kept FP32: the recipe's float_graphs)"}
            elif precision == "fp16":
                done[name] = quantize_ort.to_fp16(src, dst)
            elif precision == "int8":
                sens = ctx.recipe.dynamic
                measured: dict[str, Any] = {}
                if sens is not None and sens.max_state_error > 0 and name == ctx.recipe.onnx_file:
                    feats = calibration_features(ctx, calibration())
                    measured = keep_float(ctx, src, sens.max_state_error, feats, work)
                excluded = measured.get("nodes", [])
                done[name] = quantize_ort.quantize_weights_dynamic(src, dst, WHISPER_INT8_OPS, excluded)
                done[name] |= {"sensitivity": measured} if measured else {}
            elif precision in WEIGHT_ONLY:
                from .quantize_weight_only import quantize_matmul_nbits

                w = ctx.recipe.weight_spec.for_precision(precision)
                bits = WEIGHT_ONLY[precision]
                done[name] = quantize_matmul_nbits(src, dst, bits, w.block, w.symmetric, w.accuracy_level, w.algorithm)
            else:
                raise InputError(f"{ctx.recipe.name}: no {precision} path for a Whisper engine")
            ctx.hb.callback(bar)(i + 1, len(ctx.recipe.graphs))
    return {"graphs": done, "seconds": round(time.perf_counter() - t0, 2)}


def calibration_features(ctx: StageContext, manifest: Path, padding_s: float = 6.0) -> list[np.ndarray]:
    """Log-mel inputs of the calibration audio (``manifest``, the recipe's ``[calibration] samples`` of it),
    each over its audio and ``padding_s`` (a final's window as served)."""
    from ..audio.wav import read_audio
    from ..models.asr_whisper import WhisperFeatureConfig, log_mel_spectrogram
    from .datasets import read_audio_manifest

    spec = ctx.recipe.calibration
    assert spec is not None  # the recipe's validator requires it with [dynamic]
    cfg = WhisperFeatureConfig.from_folder(ctx.ref.path)
    out = []
    for s in read_audio_manifest(manifest, spec.samples):
        try:
            x, _ = read_audio(s.audio, cfg.sampling_rate)
        except InputError as exc:
            raise InputError(f"line {s.line}: {exc}") from None
        x = x[: cfg.n_samples]
        frames = min(cfg.nb_max_frames, 2 * int(np.ceil((x.size + padding_s * cfg.sampling_rate) / cfg.hop_length / 2)))
        out.append(log_mel_spectrogram(x, cfg)[None, :, :frames].astype(np.float32))
    if not out:
        raise InputError(f"{ctx.recipe.name}: the [calibration] manifest has no audio for [dynamic]'s pass")
    return out


def keep_float(ctx: StageContext, src: Path, budget: float, feats: Sequence[np.ndarray], work: Path) -> dict[str, Any]:
    """The encoder's weight matmuls to keep FP32 so that its dynamic-INT8 states on the calibration audio are
    within ``budget`` (mean relative error against FP32's); what the pass measured, for the report."""
    import onnx
    import onnxruntime as ort

    graph = onnx.load(str(src), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    candidates = {
        n.name: next(i for i in n.input if i in weights)
        for n in graph.node
        if n.op_type in WHISPER_INT8_OPS and any(i in weights for i in n.input) and n.name  # kept by name
    }
    so = ort.SessionOptions()
    so.intra_op_num_threads = ctx.threads or 0

    def states(path: Path) -> list[np.ndarray]:
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return [sess.run(["last_hidden_state"], {"input_features": f})[0] for f in feats]

    ref = states(src)
    tmp = work / "sensitivity.onnx"

    def error(excluded: Sequence[str]) -> float:
        ctx.hb.check()
        quantize_ort.quantize_weights_dynamic(src, tmp, WHISPER_INT8_OPS, excluded)
        errs = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(states(tmp), ref, strict=True)]
        return round(float(np.mean(errs)), 5)

    t0 = time.perf_counter()
    report: dict[str, Any] = {"budget": budget, "samples": len(feats), "error_all_int8": error([])}
    if report["error_all_int8"] > budget:
        alone: dict[str, float] = {}
        with ctx.hb.bar("ranking the encoder's matmuls by their INT8 error", "matmuls") as bar:
            for i, node in enumerate(candidates):
                alone[node] = error([node])
                ctx.hb.callback(bar)(i + 1, len(candidates))
        ranked = sorted(alone, key=alone.__getitem__)
        kept: list[str] = []
        for node in ranked:
            kept.append(node)
            report["error"] = error(kept)
            if report["error"] <= budget:
                break
        report |= {
            "nodes": kept,
            "weights": [candidates[n] for n in kept],
            "error_with_one_fp32": {candidates[n]: alone[n] for n in ranked},
        }
    tmp.unlink(missing_ok=True)
    return report | {"of": len(candidates), "seconds": round(time.perf_counter() - t0, 1)}


def compile_graphs(ctx: StageContext, staged: Path) -> dict:
    """Each converted graph (the source's, for FP32) through ONNX Runtime's optimizer into the engine folder."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for name in ctx.recipe.graphs:
        ctx.hb.check()
        converted = staged / "work" / name
        out[name] = quantize_ort.optimize(
            converted if converted.is_file() else ctx.ref.path / name, staged / "model" / name, ctx.threads
        )
    return {"graphs": out, "seconds": round(time.perf_counter() - t0, 2)}


class WhisperProbe:
    """Transcribes held-out utterances with a Whisper folder's recogniser, as it is served (one pass each)."""

    def __init__(self, ref: ModelRef) -> None:
        if ref.kind != "asr-whisper":
            raise ModelError(f"{ref.name}: a recipe with graphs builds Whisper folders; this one is a {ref.kind}")
        self.ref = ref

    def runner(self, folder: Path, backend: str = "onnxruntime", options: SessionOptions | None = None):
        """The recogniser of ``folder`` (the source, or an engine built from it), language fixed to English
        when the model is multilingual, so a candidate's language guess cannot differ from FP32's."""
        from ..models.asr_whisper import WhisperRecognizer

        ref = inspect_folder(Path(folder), name=self.ref.name)
        return WhisperRecognizer.open(ref, backend, options or SessionOptions(threads=1), language="en")

    def run(
        self, recognizer: WhisperRecognizer, samples: Sequence[AudioSample], progress: Progress | None = None
    ) -> tuple[Timed, list[str]]:
        """Token ids per utterance, the compute time of each, and the transcripts."""
        import numpy as np

        from ..audio.wav import read_audio
        from .model_io import Timed

        outs, lat, texts = [], [], []
        for i, s in enumerate(samples):
            try:
                audio, _ = read_audio(s.audio, recognizer.sample_rate)
            except InputError as exc:
                raise InputError(f"line {s.line}: {exc}") from None
            t0 = time.perf_counter()
            hyp = recognizer.transcribe(audio)
            lat.append((time.perf_counter() - t0) * 1e3)
            outs.append(np.asarray(hyp.token_ids, np.int64))
            texts.append(hyp.text)
            if progress:
                progress(i + 1, len(samples))
        return Timed(outs, lat), texts
