"""Weight-only decode benchmark: FP32 vs INT8 weight-only vs INT4, batch-1 decode tokens/s side by side.

    edge-agent bench weight-only --recipe demo-phi3-small [--backend onnxruntime|openvino]
        [--rounds 5] [--prompts 4] [--tokens 64] [--threads 1] [--json OUT]

From code: ``render(run(WeightOnlyOptions(recipe="demo-phi3-small")))`` (``bench/options.py``).

The engines are made here from the recipe's model with the recipe's ``[weight_only]`` settings, by
the same converters ``edge-agent build`` uses (ONNX Runtime MatMulNBits; OpenVINO NNCF
``compress_weights``, and the FP32 IR for OpenVINO's reference), in a temporary folder: no gate, so
an engine the gate would refuse (INT4 on random weights) is measured too; the gate's verdicts come
from ``edge-agent build``. Every engine is opened with the agent's own model loader
(``DecoderLM.open``) and decodes greedily with the KV cache after the held-out prompts of the
recipe; the engines take turns within each round, and each round's ms/token is the median over its
prompts. The table shows the median over rounds, the spread (min-max of the round medians), the
ratio to FP32 of the same run, and the weight bytes each token reads.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..backends import SessionOptions
from ..engines import decode_timing as dt
from ..engines.datasets import read_text_manifest
from ..engines.model_io import LlmProbe
from ..engines.quantize_ort import copy_sidecars
from ..engines.recipes import WEIGHT_ONLY, Recipe, load_recipe
from ..engines.weight_bytes import weight_bytes
from ..errors import InputError
from ..models.catalog import ModelRef, inspect_folder, resolve_model
from ..models.llm import DecoderLM
from .options import WeightOnlyOptions


def make_engines(recipe: Recipe, ref: ModelRef, backend: str, work: Path) -> dict[str, Path]:
    """Model folders for fp32, int8w and int4 on ``backend`` (fp32 on ONNX Runtime is the source folder)."""
    spec = recipe.weight_spec
    src = ref.path / recipe.onnx_file
    folders: dict[str, Path] = {}
    if backend == "onnxruntime":
        from ..engines.quantize_weight_only import quantize_matmul_nbits

        folders["fp32"] = ref.path
        for precision, bits in WEIGHT_ONLY.items():
            folder = work / precision
            copy_sidecars(ref.path, folder, recipe.onnx_file)
            quantize_matmul_nbits(src, folder / "model.onnx", bits, **spec.ort_args(precision), source=ref)
            folders[precision] = folder
        return folders
    from ..engines import quantize_openvino as qov

    for precision in ("fp32", *WEIGHT_ONLY):
        folder = work / precision
        copy_sidecars(ref.path, folder, recipe.onnx_file)
        xml = folder / "openvino_model.xml"
        if precision == "fp32":
            qov.to_ir(src, xml)
        else:
            own = spec.for_precision(precision)
            qov.compress_weights(src, xml, WEIGHT_ONLY[precision], own.block, own.symmetric)
        folders[precision] = folder
    return folders


def check(opts: WeightOnlyOptions) -> None:
    """Refuse options no run can take (``InputError``), before anything is loaded."""
    if min(opts.rounds, opts.prompts, opts.tokens, opts.threads) < 1:
        raise InputError("--rounds, --prompts, --tokens and --threads must be at least 1")
    if opts.engines and opts.backend != "onnxruntime":
        raise InputError("--engine takes ONNX Runtime engine folders (--backend onnxruntime)")
    for label, folder in opts.engines.items():
        if not (Path(folder) / "model.onnx").is_file():
            raise InputError(f"--engine {label}={folder}: no model.onnx there")


def run(opts: WeightOnlyOptions) -> dict[str, Any]:
    """Build the three engines of ``opts.recipe`` (or take ``opts.engines``: label -> built engine folder,
    e.g. the cache's, beside the FP32 source), then time them interleaved; returns the figures (see ``render``)."""
    from ..config import load_settings

    check(opts)
    settings = load_settings(None)
    recipe = load_recipe(opts.recipe, settings.engines.recipes_dir)
    folder = recipe.resolve(recipe.model)
    ref = resolve_model(folder if folder.is_dir() else recipe.model, settings.models.cache_dir)
    if recipe.heldout is None:
        raise InputError(f"recipe {recipe.name} has no [heldout] prompts to decode after")
    probe = LlmProbe(ref, recipe.calibration.max_tokens if recipe.calibration else 64)
    ids = [probe.token_ids(s) for s in read_text_manifest(recipe.resolve(recipe.heldout.data), opts.prompts)]
    with tempfile.TemporaryDirectory(prefix="edge-agent-weight-only-") as tmp:
        if opts.engines:
            folders = {"fp32": ref.path, **{label: Path(f) for label, f in opts.engines.items()}}
        else:
            folders = make_engines(recipe, ref, opts.backend, Path(tmp))
        per_round = _time_engines(folders, ref, ids, opts)
        graph = "model.onnx" if opts.backend == "onnxruntime" else "openvino_model.xml"
        sizes = {
            name: weight_bytes(path / (recipe.onnx_file if path == ref.path else graph))
            for name, path in folders.items()
        }
    return {
        "recipe": recipe.name,
        "model": ref.name,
        "backend": opts.backend,
        "threads": opts.threads,
        "rounds": opts.rounds,
        "prompts": len(ids),
        "new_tokens": opts.tokens,
        "weight_only": recipe.weight_spec.model_dump(mode="json"),
        "rows": _rows(per_round, sizes, opts.backend),
    }


def _time_engines(
    folders: dict[str, Path], ref: ModelRef, ids: list[list[int]], opts: WeightOnlyOptions
) -> dict[str, list[float]]:
    """Open every engine and decode the prompts, the engines taking turns; ms/token per engine per round."""
    options = SessionOptions(device="cpu" if opts.backend == "onnxruntime" else "CPU", threads=opts.threads)
    lms: dict[str, DecoderLM] = {}
    try:
        for name, folder in folders.items():
            lms[name] = DecoderLM.open(inspect_folder(folder, name=f"{ref.name}-{name}"), opts.backend, options)
        per_round: dict[str, list[float]] = {name: [] for name in lms}
        for r in range(opts.rounds):  # one interleaved pass per round; the round's figure is its median
            order = dict(reversed(list(lms.items()))) if r % 2 else lms  # who goes first alternates
            once = dt.interleaved(order, ids, rounds=1, new_tokens=opts.tokens)
            for name, values in once.items():
                per_round[name].append(dt.median(values))
    finally:
        for lm in lms.values():
            lm.close()
    return per_round


def _rows(per_round: dict[str, list[float]], sizes: dict[str, int | None], backend: str) -> list[dict[str, Any]]:
    """The table's rows: tokens/s (median and spread over rounds), ms/token, the ratio to FP32, bytes/token."""
    fp32 = float(np.median(per_round["fp32"]))
    rows = []
    for name, ms in per_round.items():
        med = float(np.median(ms))
        rows.append(
            {
                "engine": f"{backend}/{name}",
                "tok_s": 1e3 / med,
                "tok_s_min": 1e3 / max(ms),
                "tok_s_max": 1e3 / min(ms),
                "ms_per_token": med,
                "speedup": fp32 / med,
                "bytes_per_token": sizes[name],
                "rounds_ms_per_token": ms,
            }
        )
    return rows


def render(result: dict[str, Any]) -> str:
    head = f"{'engine':<22} {'tok/s':>8} {'(min-max of rounds)':>20} {'ms/token':>9} {'vs fp32':>8} {'bytes/tok':>10}"
    lines = [
        f"{result['model']}: batch-1 greedy decode with the KV cache, {result['prompts']} prompts x "
        f"{result['new_tokens']} tokens, {result['rounds']} interleaved rounds, {result['threads']} thread(s); "
        f"weight_only {result['weight_only']}",
        "",
        head,
        "-" * len(head),
    ]
    for r in result["rows"]:
        spread = f"{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}"
        lines.append(
            f"{r['engine']:<22} {r['tok_s']:8.1f} {spread:>20} {r['ms_per_token']:9.3f} {r['speedup']:7.2f}x"
            f" {(r['bytes_per_token'] or 0) / 1e6:7.1f} MB"
        )
    return "\n".join(lines)
