"""The per-backend work of a build step: convert to the precision, compile, open the result.

The artifact is a model folder (``staging/<key>/model/``): the source folder's config, tokenizer
and vocabulary files plus the converted graph (``model.onnx`` for ONNX Runtime,
``openvino_model.xml``/``.bin`` + compiled blob for OpenVINO, ``model.plan`` for TensorRT), so a
cached engine opens like any model folder.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..backends import SessionOptions, open_session
from ..backends.npu import LlmShape
from ..errors import InputError
from ..models.catalog import ModelRef
from . import quantize_ort
from .datasets import capture_manifest
from .heartbeat import Heartbeat
from .recipes import WEIGHT_ONLY, Recipe, input_shapes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageContext:
    """What a stage needs from the build it runs in (the pipeline makes one per build)."""

    recipe: Recipe
    ref: ModelRef  # the source model folder (FP32 export)
    threads: int
    hb: Heartbeat
    timing_dir: Path  # the engine cache's TensorRT timing caches


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """What to build: the target and precision, and overrides of the recipe's backend, flavour and data."""

    target: str
    precision: str
    backend: str | None = None
    flavour: str | None = None  # int8: qdq | dynamic | nncf
    data: Path | None = None  # calibration manifest override
    method: str | None = None  # calibration method override
    force: bool = False  # rebuild even when a verified entry exists


KeyParts = dict[str, Any]  # a build's cache-key parts (``Pipeline.key_parts``): what the stages read


def calibration_path(recipe: Recipe, req: BuildRequest) -> Path:
    """The calibration manifest of a build: ``--data`` (a manifest, or a capture directory's manifest for the
    recipe's workload), else the recipe's ``[calibration] data``."""
    if req.data is not None:
        return capture_manifest(Path(req.data), recipe.workload)
    if recipe.calibration is None:
        raise InputError(f"recipe {recipe.name} has no [calibration] data; pass --data MANIFEST")
    return recipe.resolve(recipe.calibration.data)


_GRAPHS = {"onnxruntime": "model.onnx", "openvino": "openvino_model.xml", "tensorrt": "model.plan"}


def graph_name(backend: str) -> str:
    return _GRAPHS[backend]


def _op_types(ctx: StageContext) -> list[str]:
    ops = quantize_ort.LLM_OPS if ctx.recipe.workload == "llm" else quantize_ort.ASR_OPS
    ignored = set(ctx.recipe.calibration.ignored_types) if ctx.recipe.calibration else set()
    return [op for op in ops if op not in ignored]


def _ignored(ctx: StageContext) -> list[str]:
    return list(ctx.recipe.calibration.ignored_types) if ctx.recipe.calibration else []


def calibration_feeds(ctx: StageContext, req: BuildRequest) -> list[dict]:
    """The real model inputs of the calibration set (prefills for LLMs, streamed chunks for ASR).

    ONNX Runtime's histogram calibrators (entropy, percentile) stack each tensor over all samples,
    so every sample must have the same shape: LLM prompts are then packed into windows of
    ``max_tokens`` tokens, and ASR keeps the full-size chunks (the short flushed tails are dropped)."""
    from collections import Counter

    from .datasets import read_audio_manifest, read_text_manifest
    from .model_io import AsrProbe, LlmProbe

    recipe, spec = ctx.recipe, ctx.recipe.calibration
    path = calibration_path(ctx.recipe, req)
    limit = spec.samples if spec else 64
    method = req.method or (spec.method if spec else "minmax")
    same_shapes = method != "minmax"
    with ctx.hb.bar("calibration inputs", "samples") as bar:
        cb = ctx.hb.callback(bar)
        if recipe.workload == "llm":
            samples = read_text_manifest(path, limit)
            max_tokens = spec.max_tokens if spec else 64
            probe = LlmProbe(ctx.ref, max_tokens if not same_shapes else 1 << 30)
            sequences = []
            for i, s in enumerate(samples):
                sequences.append(probe.token_ids(s))
                cb(i + 1, len(samples))
            if same_shapes:
                stream = [t for ids in sequences for t in ids]
                sequences = [stream[i : i + max_tokens] for i in range(0, len(stream) - max_tokens + 1, max_tokens)]
                if not sequences:
                    raise InputError(
                        f"{path}: {len(stream)} tokens in all, fewer than one window of max_tokens = "
                        f"{max_tokens}; add samples or lower max_tokens"
                    )
            else:
                sequences = [ids[:max_tokens] for ids in sequences]
            session = open_session(
                ctx.ref.path / recipe.onnx_file,
                "onnxruntime",
                SessionOptions(threads=ctx.threads),
                warmup=lambda s: None,
            )
            try:
                return [probe.feeds(session, ids) for ids in sequences]
            finally:
                session.close()
        feeds = AsrProbe(ctx.ref).calibration_feeds(read_audio_manifest(path, limit), cb)
        if same_shapes and feeds:
            shape_of = lambda f: tuple((k, v.shape) for k, v in sorted(f.items()))  # noqa: E731
            common, _ = Counter(shape_of(f) for f in feeds).most_common(1)[0]
            feeds = [f for f in feeds if shape_of(f) == common]
        return feeds


def convert(ctx: StageContext, staged: Path, parts: KeyParts, req: BuildRequest) -> dict:
    """The build's graph at its precision, into ``staged/work`` (ONNX) or ``staged/model`` (OpenVINO IR),
    the model folder's other files beside it; what was done, for the report."""
    if ctx.recipe.graphs:  # Whisper: three graphs, one engine folder
        from . import whisper_engine

        return whisper_engine.convert(ctx, staged, parts, lambda: calibration_path(ctx.recipe, req))
    src = ctx.ref.path / ctx.recipe.onnx_file
    work = staged / "work"
    work.mkdir(exist_ok=True)
    model_dir = staged / "model"
    quantize_ort.copy_sidecars(ctx.ref.path, model_dir, ctx.recipe.onnx_file)
    t0 = time.perf_counter()
    layout: dict[str, Any] | None = None
    if parts.get("layout"):  # in-place KV: every precision below is made from the converted graph
        from .inplace_kv import convert_inplace

        layout = convert_inplace(ctx.ref.path, work / "inplace", ctx.recipe.onnx_file, threads=ctx.threads)
        shutil.copy2(work / "inplace" / "genai_config.json", model_dir / "genai_config.json")
        src = source_graph(ctx, staged, parts)
    backend = parts["backend"]
    if backend in ("onnxruntime", "tensorrt"):
        out = _convert_onnx(ctx, src, work / "model.onnx", parts, req)
    elif backend == "openvino":
        out = _convert_openvino(ctx, src, model_dir / graph_name("openvino"), parts, req)
    else:
        raise InputError(f"unknown backend {backend!r}")
    if layout is not None:
        out["kv_layout"] = layout
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _convert_onnx(ctx: StageContext, src: Path, dst: Path, parts: KeyParts, req: BuildRequest) -> dict:
    """An ONNX graph for ONNX Runtime or TensorRT: as exported, FP16, weight-only, or INT8 (Q/DQ, dynamic)."""
    backend, precision, flavour = parts["backend"], parts["precision"], parts["flavour"]
    if precision == "fp32":
        return {"tool": "none (the FP32 export)", "source": str(src)}
    if precision == "fp16":
        if backend == "tensorrt" and not _trt_strongly_typed(parts):
            return {"tool": "none: TensorRT < 11 converts with BuilderFlag.FP16", "source": str(src)}
        return quantize_ort.to_fp16(src, dst)
    if precision in WEIGHT_ONLY and backend == "onnxruntime":
        from .quantize_weight_only import quantize_matmul_nbits

        # the calibrated methods (GPTQ, the sensitivity pass) run for minutes: each step they report is shown
        with ctx.hb.bar(f"{precision} weight-only", "steps") as bar:
            steps = [0]

            def say(message: str) -> None:
                ctx.hb.beat()
                steps[0] += 1
                bar.label = f"{precision} weight-only: {message}"
                bar.update(steps[0])

            return quantize_matmul_nbits(
                src,
                dst,
                WEIGHT_ONLY[precision],
                **ctx.recipe.weight_spec.ort_args(precision),
                source=ctx.ref,
                threads=ctx.threads,
                progress=say,
            )
    if precision == "int8" and flavour == "calibrator":
        return {"tool": "TensorRT IInt8EntropyCalibrator2 at compile time (TensorRT < 11)", "method": "entropy"}
    if precision == "int8" and flavour == "dynamic":
        return quantize_ort.quantize_weights_dynamic(src, dst, _op_types(ctx))
    if precision == "int8":
        method = (parts["calibration"] or {}).get("method", "minmax")
        feeds = calibration_feeds(ctx, req)
        with ctx.hb.bar(f"calibrating ({method})", "batches") as bar:
            return quantize_ort.quantize_qdq(src, dst, feeds, method, _op_types(ctx), progress=ctx.hb.callback(bar))
    raise InputError(f"{backend} has no {precision} path here: {weight_only_unsupported(backend, precision)}")


def _convert_openvino(ctx: StageContext, src: Path, xml: Path, parts: KeyParts, req: BuildRequest) -> dict:
    """An OpenVINO IR: the NPU's stateful LLM form, FP32/FP16, weight compression, or NNCF INT8."""
    from . import quantize_openvino as qov

    precision, flavour = parts["precision"], parts["flavour"]
    npu = npu_llm(ctx, parts)
    if npu:  # the NPU runs LLMs only in its plugin's LLM mode, from a stateful IR
        if precision == "int8" and flavour != "weights":
            raise InputError("the NPU's LLM mode takes weight-only formats: build int4 (or int8w, fp16) for intel-npu")
        weights = "int8w" if precision == "int8" else precision
        window = ctx.ref.config.get("sliding_window")
        capacity = npu["npu_llm"].capacity
        block = ctx.recipe.weight_spec.for_precision(weights).block
        return qov.stateful_ir(src, xml, weights, block, window, capacity)
    if precision in ("fp32", "fp16"):
        return qov.to_ir(src, xml, fp16=precision == "fp16")
    if precision in WEIGHT_ONLY:
        spec = ctx.recipe.weight_spec.for_precision(precision)
        return qov.compress_weights_for(src, xml, WEIGHT_ONLY[precision], spec, ctx.ref)
    if precision == "int8" and flavour == "weights":
        return qov.compress_weights(src, xml, 8)
    feeds = calibration_feeds(ctx, req)
    with ctx.hb.bar("NNCF quantize", "samples") as bar:
        return qov.quantize_int8(src, xml, feeds, ctx.recipe.workload, _ignored(ctx), progress=ctx.hb.callback(bar))


def source_graph(ctx: StageContext, staged: Path, parts: KeyParts) -> Path:
    """The graph a build's precision is made from: the in-place KV conversion when the build has one."""
    if parts.get("layout"):
        return staged / "work" / "inplace" / "model.onnx"
    return ctx.ref.path / ctx.recipe.onnx_file


def weight_only_unsupported(backend: str, precision: str) -> str | None:
    """Why ``backend`` cannot build the weight-only ``precision`` (None when it can)."""
    if precision not in WEIGHT_ONLY or backend in ("onnxruntime", "openvino"):
        return None
    return (
        f"{precision} is weight-only quantization (ONNX Runtime MatMulNBits, OpenVINO NNCF compress_weights); "
        f"{backend} has no weight-only path here"
    )


def _trt_strongly_typed(parts: KeyParts) -> bool:
    from .tensorrt_build import is_strongly_typed_only

    return is_strongly_typed_only(parts["runtime_version"])


def compile_artifact(ctx: StageContext, staged: Path, parts: KeyParts, req: BuildRequest) -> dict:
    backend, precision = parts["backend"], parts["precision"]
    if ctx.recipe.graphs:
        from .whisper_engine import compile_graphs

        return compile_graphs(ctx, staged)
    src = source_graph(ctx, staged, parts)
    converted = staged / "work" / "model.onnx"
    model_dir = staged / "model"
    t0 = time.perf_counter()
    if backend == "onnxruntime":
        out = quantize_ort.optimize(converted if converted.is_file() else src, model_dir / "model.onnx", ctx.threads)
    elif backend == "openvino":
        from .quantize_openvino import compile_blob

        device = "NPU" if parts["target"] == "intel-npu" else "CPU"
        out = compile_blob(
            model_dir / graph_name(backend),
            model_dir,
            device,
            ov_hint(parts),
            ctx.threads,
            static_shapes(ctx, parts),
            npu_llm(ctx, parts),
        )
    else:
        from ..graphs.tensorrt import decoder_profile_problems, last_position_graph
        from .tensorrt_build import BuildSpec, build_plan, load_tensorrt

        trt = load_tensorrt()
        onnx_path = converted if converted.is_file() else src
        graph, graph_notes = last_position_graph(onnx_path)
        profiles = profile_shapes(ctx.recipe, parts["target"], onnx_path)
        problems = decoder_profile_problems(profiles, ctx.ref.config.get("max_position_embeddings"))
        if problems:
            raise InputError(f"recipe {ctx.recipe.name}: {'; '.join(problems)}")
        calibrator = None
        if parts["flavour"] == "calibrator":
            from ..backends.cuda import select_cuda
            from .tensorrt_build import entropy_calibrator

            calibrator = entropy_calibrator(
                trt, select_cuda(None, 0), calibration_feeds(ctx, req), staged / "work" / "calibration.cache"
            )
        spec = BuildSpec(
            onnx=onnx_path,
            plan=model_dir / "model.plan",
            precision=precision,
            profiles=profiles,
            timing_cache=ctx.timing_dir / f"trt-{parts['runtime_version']}-"
            f"{parts['device'].replace(':', '_').replace(' ', '_')}.cache",
            calibrator=calibrator,
            graph=graph,
        )
        # TensorRT calls this from C++: keep systemd patient, never raise here (a cancel waits for the plan).
        out = build_plan(trt, spec, progress=lambda *_: ctx.hb.pulse())
        out.update(graph_notes)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _inputs(onnx_path: Path) -> list[tuple[str, tuple]]:
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    out = []
    for value in model.graph.input:
        if value.name in init:
            continue
        dims = value.type.tensor_type.shape.dim
        out.append((value.name, tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims)))
    return out


def profile_shapes(recipe: Recipe, target: str, onnx_path: Path) -> list[tuple[str, dict]]:
    """(profile name, {input: (min, opt, max)}) for the target; a mismatch with the model is an error."""
    profiles = recipe.profiles_for(target)
    if not profiles:
        raise InputError(f"recipe {recipe.name} has no shape profile for target {target}")
    inputs = _inputs(onnx_path)
    return [(p.name, input_shapes(p, inputs)) for p in profiles]


def npu_llm(ctx: StageContext, parts: KeyParts) -> dict[str, LlmShape]:
    """For an LLM built for the NPU: the plugin's LLM mode as the key says (``key_parts["npu_llm"]``)."""
    spec = parts.get("npu_llm")
    if parts["target"] != "intel-npu" or ctx.recipe.workload != "llm" or not spec:
        return {}
    return {"npu_llm": LlmShape(spec["max_prompt"], spec["min_response"], spec["generate_tokens"])}


def static_shapes(ctx: StageContext, parts: KeyParts) -> dict[str, tuple[int, ...]] | None:
    if parts["target"] != "intel-npu" or npu_llm(ctx, parts):
        return None
    _name, shapes = profile_shapes(ctx.recipe, parts["target"], ctx.ref.path / ctx.recipe.onnx_file)[0]
    return {inp: lo for inp, (lo, _, _) in shapes.items()}


def ov_hint(parts: KeyParts) -> Literal["fp16", "fp32"]:
    """OpenVINO's inference precision for the engine. The same at compile and at load, or the cached
    blob would not match. On CPUs f32: FP16/INT8/INT4 live in the IR's weights, and x86 CPUs have
    no f16 arithmetic to gain from; the NPU computes f16."""
    return "fp16" if parts["precision"] == "fp16" and parts["target"] != "cpu" else "fp32"


def open_candidate(ctx: StageContext, folder: Path, parts: KeyParts):
    """The built engine opened ready to run: a Session (LLM) or a streaming runner (ASR)."""
    from .model_io import AsrProbe

    backend = parts["backend"]
    if backend == "onnxruntime":
        options = SessionOptions(device="cpu", threads=ctx.threads)
    elif backend == "openvino":
        options = SessionOptions(
            device="NPU" if parts["target"] == "intel-npu" else "CPU",
            precision=ov_hint(parts),
            threads=ctx.threads,
            cache_dir=folder,
            static_shapes=static_shapes(ctx, parts),
            extra=npu_llm(ctx, parts),
        )
    else:
        options = SessionOptions(device="cuda:0")
    graph = folder / graph_name(backend)
    if ctx.recipe.graphs:
        from .whisper_engine import WhisperProbe

        return WhisperProbe(ctx.ref).runner(folder, backend, options)
    if ctx.recipe.workload == "asr":
        return AsrProbe(ctx.ref).runner(graph, backend, options)
    return open_session(graph, backend, options, warmup=lambda s: None)
