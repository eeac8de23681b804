"""Weight-only decode benchmark: FP32 vs INT8 weight-only vs INT4, batch-1 decode tokens/s side by side.

    python -m edge_agent.bench.weight_only --recipe demo-phi3-small [--backend onnxruntime|openvino]
        [--rounds 5] [--prompts 4] [--tokens 64] [--threads 1] [--json OUT]

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

import argparse
import json
import sys
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
from ..models.catalog import ModelRef, inspect_folder, resolve_model
from ..models.llm import DecoderLM


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
            quantize_matmul_nbits(src, folder / "model.onnx", bits, **spec.ort_args(), source=ref)
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
            qov.compress_weights(src, xml, WEIGHT_ONLY[precision], spec.block_size, spec.symmetric)
        folders[precision] = folder
    return folders


def run(
    recipe: Recipe,
    models_dir: Path,
    backend: str,
    rounds: int,
    prompts: int,
    tokens: int,
    threads: int,
    engines: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """Build the three engines (or take ``engines``: label -> built engine folder, e.g. the cache's, beside
    the FP32 source), then time them interleaved; returns the figures (see ``render``)."""
    folder = recipe.resolve(recipe.model)
    ref = resolve_model(folder if folder.is_dir() else recipe.model, models_dir)
    if recipe.heldout is None:
        raise SystemExit(f"recipe {recipe.name} has no [heldout] prompts to decode after")
    probe = LlmProbe(ref, recipe.calibration.max_tokens if recipe.calibration else 64)
    samples = read_text_manifest(recipe.resolve(recipe.heldout.data), prompts)
    ids = [probe.token_ids(s) for s in samples]
    with tempfile.TemporaryDirectory(prefix="edge-agent-weight-only-") as tmp:
        if engines:
            folders = {"fp32": ref.path, **engines}
            for label, folder in engines.items():
                if not (folder / "model.onnx").is_file():
                    raise SystemExit(f"--engine {label}={folder}: no model.onnx there")
        else:
            folders = make_engines(recipe, ref, backend, Path(tmp))
        options = SessionOptions(device="cpu" if backend == "onnxruntime" else "CPU", threads=threads)
        lms: dict[str, DecoderLM] = {}
        try:
            for name, folder in folders.items():
                lms[name] = DecoderLM.open(inspect_folder(folder, name=f"{ref.name}-{name}"), backend, options)
            per_round: dict[str, list[float]] = {name: [] for name in lms}
            for r in range(rounds):  # one interleaved pass per round; the round's figure is its median
                order = dict(reversed(list(lms.items()))) if r % 2 else lms  # who goes first alternates
                once = dt.interleaved(order, ids, rounds=1, new_tokens=tokens)
                for name, values in once.items():
                    per_round[name].append(dt.median(values))
        finally:
            for lm in lms.values():
                lm.close()
        graph = "model.onnx" if backend == "onnxruntime" else "openvino_model.xml"
        sizes = {
            name: weight_bytes(path / (recipe.onnx_file if path == ref.path else graph))
            for name, path in folders.items()
        }
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
    return {
        "recipe": recipe.name,
        "model": ref.name,
        "backend": backend,
        "threads": threads,
        "rounds": rounds,
        "prompts": len(ids),
        "new_tokens": tokens,
        "weight_only": recipe.weight_spec.model_dump(mode="json"),
        "rows": rows,
    }


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


def main(argv: list[str] | None = None) -> int:
    from ..config import load_settings

    p = argparse.ArgumentParser(prog="python -m edge_agent.bench.weight_only", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="demo-phi3-small", help="recipe file or name (default demo-phi3-small)")
    p.add_argument("--backend", choices=["onnxruntime", "openvino"], default="onnxruntime")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per round (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per prompt (default 64)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="LABEL=FOLDER",
        help="time this built engine folder (e.g. a cache entry's model/) instead of making int8w and int4",
    )
    args = p.parse_args(argv)
    engines = {}
    for item in args.engine:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            p.error(f"--engine {item!r}: LABEL=FOLDER")
        engines[label] = Path(folder).expanduser()
    if engines and args.backend != "onnxruntime":
        p.error("--engine takes ONNX Runtime engine folders (--backend onnxruntime)")
    if min(args.rounds, args.prompts, args.tokens, args.threads) < 1:
        p.error("--rounds, --prompts, --tokens and --threads must be at least 1")
    settings = load_settings(None)
    recipe = load_recipe(args.recipe, settings.engines.recipes_dir)
    result = run(
        recipe,
        settings.models.cache_dir,
        args.backend,
        args.rounds,
        args.prompts,
        args.tokens,
        args.threads,
        engines,
    )
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
