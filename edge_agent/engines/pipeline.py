"""Build orchestration: recipe + target + precision -> a gated engine in the cache.

One build runs these steps in ``staging/<key>/`` of the engine cache; each finished step leaves a
marker (``steps/<name>.json``), so an interrupted build (Ctrl-C, power loss, systemd timeout)
resumes where it stopped:

    reference   FP32 outputs of the source model on the held-out samples, on the same backend (+ latency)
    convert     the precision's artifact: optimized / FP16 / INT8 (calibrated) / INT4 model
    compile     the runtime's compiled form: ORT optimized graph, OpenVINO CACHE_DIR blob, TensorRT plan
    gate        the candidate on the held-out samples vs the reference: metrics, latency, verdict

A candidate within budget is committed (hashes, fsync, rename); one beyond budget is refused
(``GateRefused`` carries the report) and never enters the cache.

Cancellation (the agent stopping): ``Heartbeat.cancel`` is checked before every step and at every
progress tick (each held-out or calibration sample), so a build stops within one sample's worth of
native work with ``BuildCancelled``; the staging folder keeps its finished steps and nothing is
committed, so the cache never holds a half-written entry.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..backends import SessionOptions, open_session
from ..errors import BackendUnavailable, EdgeAgentError, InputError
from ..models.catalog import ModelRef, inspect_folder, resolve_model
from . import gate as gates
from .cache import EngineCache, Entry, cache_key, hash_model, mark_step, step_done
from .datasets import manifest_digest, read_audio_manifest, read_text_manifest
from .fingerprint import device_fingerprint, runtime_version
from .heartbeat import BuildCancelled, Heartbeat
from .inplace_kv import layout_for
from .model_io import AsrProbe, LlmProbe
from .recipes import TARGET_BACKENDS, NpuLlmSpec, Recipe
from .stages import (
    BuildRequest,
    StageContext,
    calibration_path,
    compile_artifact,
    convert,
    graph_name,
    open_candidate,
)
from .whisper_engine import WhisperProbe

__all__ = ["INT8_FLAVOURS", "BuildCancelled", "BuildRequest", "GateRefused", "Heartbeat", "Pipeline", "verdict_from"]

log = logging.getLogger(__name__)

# INT8 flavours per backend: how the INT8 artifact is made.
INT8_FLAVOURS = {"onnxruntime": ("qdq", "dynamic"), "openvino": ("nncf", "weights"), "tensorrt": ("qdq", "calibrator")}


class GateRefused(EdgeAgentError):
    """The candidate engine is beyond the recipe's accuracy budget; ``report`` says by how much."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


class Pipeline:
    """The resumable build steps of one recipe (see the module doc), into the engine cache."""

    def __init__(
        self, recipe: Recipe, cache: EngineCache, models_dir: Path, threads: int = 1, heartbeat: Heartbeat | None = None
    ) -> None:
        self.recipe = recipe
        self.cache = cache
        self.models_dir = models_dir
        self.threads = threads
        self.hb = heartbeat or Heartbeat()
        self._ref: ModelRef | None = None
        self._model_hash: str | None = None

    # -- identity --------------------------------------------------------------------------------

    @property
    def ref(self) -> ModelRef:
        if self._ref is None:
            model = self.recipe.model
            candidate = self.recipe.resolve(model)
            self._ref = resolve_model(candidate if candidate.is_dir() else model, self.models_dir)
            for graph in self.recipe.graphs or [self.recipe.onnx_file]:
                if not (self._ref.path / graph).is_file():
                    raise InputError(f"{self._ref.path}: no {graph} (recipe onnx_file / graphs)")
        return self._ref

    @property
    def model_hash(self) -> str:
        if self._model_hash is None:
            self._model_hash = hash_model(self.ref.path, self.cache.root / "model-hashes.json")
        return self._model_hash

    def backend_for(self, req: BuildRequest) -> str:
        if req.backend:
            if req.backend not in TARGET_BACKENDS[req.target]:
                raise InputError(f"target {req.target} builds for {TARGET_BACKENDS[req.target]}, not {req.backend}")
            return req.backend
        return TARGET_BACKENDS[req.target][0]

    def calibration_path(self, req: BuildRequest) -> Path:
        return calibration_path(self.recipe, req)

    def stage_context(self) -> StageContext:
        """What the stages need from this build (they never see the pipeline itself)."""
        return StageContext(self.recipe, self.ref, self.threads, self.hb, self.cache.timing_dir)

    def key_parts(self, req: BuildRequest) -> dict[str, Any]:
        backend = self.backend_for(req)
        version = runtime_version(backend)
        if version is None:
            from ..backends import BACKENDS

            raise BackendUnavailable(
                f"building for {req.target} needs {backend}, which is not installed here: "
                f"{BACKENDS[backend].install_hint}"
            )
        default_int8 = "dynamic" if self.recipe.graphs else INT8_FLAVOURS[backend][0]  # Whisper: whisper_engine
        flavour = req.flavour or (default_int8 if req.precision == "int8" else "")
        if req.precision == "int8" and flavour not in INT8_FLAVOURS[backend]:
            raise InputError(f"{backend} INT8 is made as {INT8_FLAVOURS[backend]}, not {flavour!r}")
        calib = None
        spec = self.recipe.calibration
        if req.precision == "int8" and flavour not in ("dynamic", "weights"):
            path = self.calibration_path(req)
            calib = {
                "data": manifest_digest(path, spec.samples if spec else None),
                "method": req.method or (spec.method if spec else "minmax"),
            }
        elif req.precision == "int8" and self.recipe.dynamic and self.recipe.dynamic.max_state_error > 0:
            # Whisper: the matmuls kept FP32 are chosen on the calibration audio
            calib = {"data": manifest_digest(self.calibration_path(req), spec.samples if spec else None)}
        parts = {
            "model": self.model_hash,
            **self.recipe.precision_key(req.precision),  # the fingerprint, and weight-only settings
            "target": req.target,
            "precision": req.precision,
            "flavour": flavour,
            "backend": backend,
            "profiles": [p.model_dump() for p in self.recipe.profiles_for(req.target)],
            "calibration": calib,
            "runtime": backend,
            "runtime_version": version,
            "device": device_fingerprint(req.target),
        }
        if req.target == "intel-npu" and self.recipe.workload == "llm":  # the NPU plugin's LLM mode
            shape = (self.recipe.npu_llm or NpuLlmSpec()).shape()
            parts["npu_llm"] = {
                "max_prompt": shape.max_prompt,
                "min_response": shape.min_response,
                "generate_tokens": shape.generate_tokens,
            }
        r = self.recipe
        layout = layout_for(
            r.layout_of(req.precision), r.workload, self.ref.path, r.onnx_file, backend, req.precision, flavour
        )
        if layout:  # likewise: only in-place KV builds carry it
            parts["layout"] = layout
        return parts

    # -- build -----------------------------------------------------------------------------------

    def build(self, req: BuildRequest) -> dict[str, Any]:
        self.recipe.check(req.target, req.precision)
        parts = self.key_parts(req)
        key = cache_key(parts)
        if not req.force:
            entry = self.cache.lookup(key)
            if entry is not None:
                return self._hit_report(entry)
        t0 = time.perf_counter()
        with self.cache.staging(key) as staged:
            resumed = sorted(p.stem for p in (staged / "steps").glob("*.json")) if (staged / "steps").is_dir() else []
            if resumed:
                log.warning("resuming the build of %s from step(s) %s", key[:12], ", ".join(resumed))
            reference = self._step_reference(staged, parts)
            conversion = self._step(staged, "convert", lambda: convert(self.stage_context(), staged, parts, req))
            compiled = self._step(staged, "compile", lambda: compile_artifact(self.stage_context(), staged, parts, req))
            verdict = self._step(staged, "gate", lambda: self._gate(staged, parts, reference))
            report = {
                "recipe": self.recipe.name,
                "model": self.ref.name,
                "key": key,
                **_public(parts),
                "conversion": conversion,
                "compile": compiled,
                "accuracy": verdict,
                "build_s": round(time.perf_counter() - t0, 2),
                "resumed_steps": resumed,
            }
            if not verdict["passed"]:
                raise GateRefused(
                    f"{parts['backend']}/{req.precision} engine for {self.recipe.name} refused by the "
                    f"accuracy gate: {'; '.join(verdict['reasons'])}",
                    report,
                )
            self.hb.check()  # a cancelled build commits nothing
            # Intermediates stay out of the entry: only the model folder is served.
            shutil.rmtree(staged / "work", ignore_errors=True)
            (staged / "reference.npz").unlink(missing_ok=True)
            (staged / "reference_argmax.npy").unlink(missing_ok=True)
            manifest = {
                "artifact": "model",
                "graph": f"model/{self.recipe.graphs[0] if self.recipe.graphs else graph_name(parts['backend'])}",
                "recipe_name": self.recipe.name,
                "model_name": self.ref.name,
                "workload": self.recipe.workload,
                **_public(parts),
                "key_parts": parts,
                "conversion": conversion,
                "compile": compiled,
                "accuracy": verdict,
                "build_s": report["build_s"],
            }
            entry = self.cache.commit(key, staged, manifest)
        report.update(cache="built", path=str(entry.path), load_ms=self._load_ms(entry))
        return report

    def _step(self, staged: Path, name: str, run: Callable[[], dict]) -> dict:
        done = step_done(staged, name)
        if done is not None:
            return done
        self.hb.beat()
        result = run()
        mark_step(staged, name, result)
        return result

    def _hit_report(self, entry: Entry) -> dict[str, Any]:
        m = entry.manifest
        return {
            "recipe": self.recipe.name,
            "model": m.get("model_name"),
            "key": entry.key,
            **{k: m.get(k) for k in ("target", "precision", "flavour", "backend", "runtime_version", "device")},
            "accuracy": m.get("accuracy"),
            "build_s": m.get("build_s"),
            "cache": "hit",
            "path": str(entry.path),
            "load_ms": self._load_ms(entry),
        }

    # -- steps -----------------------------------------------------------------------------------

    def _heldout(self):
        spec = self.recipe.heldout
        if spec is None:
            raise InputError(f"recipe {self.recipe.name} has no [heldout] data: the accuracy gate needs it")
        path = self.recipe.resolve(spec.data)
        if self.recipe.workload == "llm":
            return read_text_manifest(path, spec.samples)
        return read_audio_manifest(path, spec.samples, need_text=True)

    def _run_held_out(
        self, session_or_runner, label: str, samples=None, every_position: bool = True
    ) -> tuple[list[np.ndarray], list[float], list[str]]:
        samples = self._heldout() if samples is None else samples
        with self.hb.bar(label, "samples") as bar:
            cb = self.hb.callback(bar)
            if self.recipe.workload == "llm":
                probe = LlmProbe(self.ref, self.recipe.calibration.max_tokens if self.recipe.calibration else 64)
                timed = probe.run(session_or_runner, samples, cb, every_position)
                return timed.outputs, timed.latency_ms, []
            asr: WhisperProbe | AsrProbe = WhisperProbe(self.ref) if self.recipe.graphs else AsrProbe(self.ref)
            heard, texts = asr.run(session_or_runner, samples, cb)
            return heard.outputs, heard.latency_ms, texts

    def _speed(self, staged: Path, parts: dict, rounds: int = 3, count: int = 8) -> dict[str, Any]:
        """Speed of the candidate beside the FP32 source, measured interleaved in rounds on the same
        samples, so background load on the device hits both alike: median latency per held-out sample
        (the prefill, for LLMs), and for LLMs batch-1 decode with the KV cache (``decode_timing``)."""
        samples = self._heldout()[:count]
        backend = "onnxruntime" if parts["backend"] == "tensorrt" else parts["backend"]
        same = is_fp32_source(parts)  # the candidate is the reference: timed once, for both columns
        reference = self._open_reference(backend)
        candidate = reference if same else open_candidate(self.stage_context(), staged / "model", parts)
        ref_ms: list[float] = []
        cand_ms: list[float] = ref_ms if same else []
        turns = [(reference, ref_ms, "fp32")] + ([] if same else [(candidate, cand_ms, parts["precision"])])
        out: dict[str, Any] = {}
        try:
            for r in range(rounds):
                for handle, acc, name in turns:
                    label = f"speed {name} (round {r + 1}/{rounds})"
                    acc.extend(self._run_held_out(handle, label, samples, every_position=False)[1])
            if self.recipe.workload == "llm":
                out = self._decode_speed(reference, None if same else candidate, samples, staged / "model", parts)
        finally:
            reference.close()
            if not same:
                candidate.close()
        out.update(prefill_ms=float(np.median(cand_ms)), reference_prefill_ms=float(np.median(ref_ms)))
        return out

    def _decode_speed(self, reference, candidate, samples, folder: Path, parts: dict) -> dict[str, Any]:
        from . import decode_timing as dt
        from .weight_bytes import weight_bytes

        probe = LlmProbe(self.ref, self.recipe.calibration.max_tokens if self.recipe.calibration else 64)
        prompts = [probe.token_ids(s) for s in samples[: dt.DECODE_PROMPTS]]
        # An in-place KV engine decodes through its own folder's adapter (per-slot buffers), as it is served.
        cand_ref = inspect_folder(folder, name=self.ref.name) if (folder / "genai_config.json").is_file() else self.ref
        engines = {"fp32": dt.adapter(self.ref, reference)}
        if candidate is not None:  # None: the candidate is the FP32 source itself
            engines["candidate"] = dt.adapter(cand_ref, candidate)
        with self.hb.bar(f"decode speed {parts['backend']}/{parts['precision']} vs fp32", "runs") as bar:
            per = dt.interleaved(engines, prompts, tick=self.hb.callback(bar))
        ref_ms, cand_ms = dt.median(per["fp32"]), dt.median(per.get("candidate", per["fp32"]))
        return {
            "timing": "decode",
            "decode_ms": cand_ms,
            "reference_decode_ms": ref_ms,
            "decode_tok_s": 1e3 / cand_ms if cand_ms else None,
            "reference_decode_tok_s": 1e3 / ref_ms if ref_ms else None,
            "decode_tokens": dt.DECODE_TOKENS,
            "weight_bytes": weight_bytes(folder / graph_name(parts["backend"])),
            "reference_weight_bytes": weight_bytes(self.ref.path / self.recipe.onnx_file),
        }

    def _step_reference(self, staged: Path, parts: dict) -> dict:
        def run() -> dict:
            backend = parts["backend"]
            if backend == "tensorrt":  # the FP32 reference of a TensorRT engine is ONNX Runtime's
                backend = "onnxruntime"
            handle = self._open_reference(backend)
            try:
                outs, lat, texts = self._run_held_out(handle, f"fp32 reference ({backend})")
            finally:
                handle.close()
            np.savez(staged / "reference.npz", *outs)
            refs = [s.text for s in self._heldout()] if self.recipe.workload == "asr" else []
            out = {"backend": backend, "latency_ms": float(np.median(lat)), "texts": texts, "references": refs}
            if self.recipe.perplexity is not None:
                out["perplexity"] = self._reference_perplexity(staged, parts, backend)
            return out

        return self._step(staged, "reference", run)

    def _reference_perplexity(self, staged: Path, parts: dict, backend: str) -> dict:
        """FP32's perplexity on the recipe's text (kept once per model, text and runtime in the cache) and
        its argmax per scored token, staged as ``reference_argmax.npy`` for the gate."""
        from . import perplexity_gate as pg

        version = parts["runtime_version"] if backend == parts["backend"] else runtime_version(backend)
        memo = (
            self.cache.root / "perplexity" / f"{pg.reference_key(self.recipe, self.model_hash, backend, version)}.npz"
        )
        with self.hb.bar(f"fp32 perplexity ({backend})", "tokens") as bar:
            report, argmax = pg.reference(
                self.recipe, self.ref, lambda: self._open_reference(backend), memo, self.hb.callback(bar)
            )
        np.save(staged / "reference_argmax.npy", argmax)
        return report

    def _open_reference(self, backend: str):
        graph = self.ref.path / self.recipe.onnx_file
        options = SessionOptions(
            device="cpu" if backend == "onnxruntime" else "CPU", precision="fp32", threads=self.threads
        )
        if self.recipe.graphs:
            return WhisperProbe(self.ref).runner(self.ref.path, backend, options)
        if self.recipe.workload == "asr":
            return AsrProbe(self.ref).runner(graph, backend, options)
        return open_session(graph, backend, options, warmup=lambda s: None)

    def _gate(self, staged: Path, parts: dict, reference: dict) -> dict:
        if parts["backend"] == "tensorrt" and not _gpu_here():
            raise BackendUnavailable(
                "the accuracy gate of a TensorRT engine runs it, which needs the Jetson's GPU: "
                "run edge-agent build on the device"
            )
        handle = open_candidate(self.stage_context(), staged / "model", parts)
        ppl = None
        # The FP32 export on the reference's runtime is the reference: its held-out outputs are run (the
        # engine opens and answers), its perplexity is the reference's, not scored a second time.
        same = is_fp32_source(parts) and self.recipe.workload == "llm"
        try:
            outs, _lat, texts = self._run_held_out(handle, f"gate {parts['backend']}/{parts['precision']}")
            if self.recipe.perplexity is not None and not same:
                from .perplexity_gate import measure

                with self.hb.bar(f"perplexity {parts['backend']}/{parts['precision']}", "tokens") as bar:
                    ppl = measure(self.recipe, self.ref, handle, self.hb.callback(bar))
        finally:
            handle.close()
        if self.recipe.workload == "llm":
            with np.load(staged / "reference.npz") as ref:
                ref_outs = [ref[f"arr_{i}"] for i in range(len(ref.files))]
            # A stateful model's steps start at position 1, a last-position engine's at its prefill's last
            # position: each compares the positions it gave, the prompt's last ones.
            ref_outs = [r[len(r) - len(o) :] if len(o) < len(r) else r for r, o in zip(ref_outs, outs)]
            metrics = gates.llm_metrics(ref_outs, outs)
            if ppl is not None or (same and self.recipe.perplexity is not None):
                ref_ppl = reference["perplexity"]["perplexity"]
                ref_argmax = np.load(staged / "reference_argmax.npy")
                if ppl is None:
                    metrics.update(gates.perplexity_metrics(ref_ppl, ref_ppl, ref_argmax, ref_argmax))
                else:
                    metrics.update(gates.perplexity_metrics(ref_ppl, ppl.perplexity, ref_argmax, ppl.argmax))
                    metrics["ppl_tokens_per_s"] = ppl.tokens_per_s
        else:
            metrics = gates.asr_metrics(reference["references"], reference["texts"], texts)
        verdict = gates.judge(
            self.recipe.workload,
            metrics,
            self.recipe.accuracy,
            parts["precision"],
            parts["backend"],
            parts["flavour"],
            rungs=self.recipe.rungs,
        )
        speed = self._speed(staged, parts)
        # An LLM's speed is its decode (ms per token, batch 1, KV cache); the prefill stays in the report.
        kind = "decode" if "decode_ms" in speed else "prefill"
        verdict.reference_latency_ms, verdict.latency_ms = speed[f"reference_{kind}_ms"], speed[f"{kind}_ms"]
        return {**verdict.to_dict(), **speed, "timing": kind if self.recipe.workload == "llm" else "sample"}

    def _load_ms(self, entry: Entry) -> float | None:
        """Time to open the cached engine ready to run (what a cache hit costs at start-up)."""
        if entry.manifest.get("backend") == "tensorrt" and not _gpu_here():
            return None
        t0 = time.perf_counter()
        handle = open_candidate(self.stage_context(), entry.artifact, entry.manifest["key_parts"])
        ms = (time.perf_counter() - t0) * 1e3
        handle.close()
        return round(ms, 1)


def is_fp32_source(parts: dict) -> bool:
    """An ONNX Runtime FP32 build without a layout change: the engine is the FP32 export itself (the
    reference the gate compares with), so it is measured once, as the reference."""
    return parts["backend"] == "onnxruntime" and parts["precision"] == "fp32" and not parts.get("layout")


def _public(parts: dict) -> dict:
    return {k: parts[k] for k in ("target", "precision", "flavour", "backend", "runtime", "runtime_version", "device")}


def _gpu_here() -> bool:
    from ..backends.tensorrt import probe_tensorrt

    return bool(probe_tensorrt().get("version"))


def verdict_from(report: dict) -> gates.Verdict:
    a = report["accuracy"]
    v = gates.Verdict(
        a["precision"],
        a["backend"],
        a["metrics"],
        a["budget"],
        a["passed"],
        a["reasons"],
        a.get("latency_ms"),
        a.get("reference_latency_ms"),
        a.get("flavour", ""),
        weight_bytes=a.get("weight_bytes"),
    )
    return v
