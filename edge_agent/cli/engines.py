"""``edge-agent calibrate``, ``edge-agent build`` and ``edge-agent engines list|verify|prune|convert``.

``--json`` prints the report as one JSON object on stdout, or writes it to the file given
(``--json report.json``). Progress with ETA goes to stderr; under systemd the build keeps the
service's start timeout extended (EXTEND_TIMEOUT_USEC) while it works.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..engines.machine_build import this_target
from ..errors import InputError
from .engine_cache_cmds import cmd_engines_list, cmd_engines_prune, cmd_engines_verify
from .engine_io import emit, open_cache

PRECISIONS = ("fp32", "fp16", "int8", "int8w", "int4")
EXIT_ALL_REFUSED = 3  # `build`/`calibrate`: every candidate refused by the accuracy gate (distinct from 1, an error)
EXIT_INTERRUPTED = 130  # Ctrl-C: what finished stays staged; the same command resumes
EXIT_CODES = (
    f"exit status: 0 an engine passed the gate and is cached (other candidates may be refused), "
    f"{EXIT_ALL_REFUSED} every candidate was refused by the accuracy gate (nothing cached), 1 an error, "
    f"2 bad usage or config, {EXIT_INTERRUPTED} interrupted (the same command resumes)"
)


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", nargs="?", const="-", metavar="OUT", help="print the report as JSON on stdout, or write it to OUT"
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    _json_arg(p)


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw accuracy against speed per candidate, budget and choice (needs edge-agent[plot])",
    )
    p.add_argument("--recipe", required=True, help="recipe file, or a name in engines.recipes_dir (e.g. demo-asr)")
    p.add_argument("--threads", type=int, help="intra-op threads for calibration and measurements (default: config)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache holds a verified engine")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="make the INT8 artifacts of a recipe and gate them against FP32", epilog=EXIT_CODES
    )
    _common(p)
    _recipe_args(p)
    p.add_argument(
        "--data",
        type=Path,
        help="calibration manifest, or a capture directory ([calibration] capture_dir) (default: the recipe's)",
    )
    p.add_argument("--method", choices=["minmax", "entropy", "percentile"], help="activation range method")
    p.add_argument(
        "--target",
        choices=["cpu", "jetson", "intel-npu"],
        help="default: device.target from the config, or this machine (Jetson, Intel NPU, else cpu)",
    )
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser(
        "build", help="build, gate and cache an engine for a target and precision", epilog=EXIT_CODES
    )
    _common(p)
    _recipe_args(p)
    p.add_argument(
        "--target",
        choices=["cpu", "jetson", "intel-npu"],
        help="default: device.target from the config, or this machine (Jetson, Intel NPU, else cpu)",
    )
    p.add_argument(
        "--precision",
        default="all",
        choices=[*PRECISIONS, "all"],
        help="default 'all': every precision the recipe lists, then the engine to use is picked",
    )
    p.add_argument("--backend", choices=["onnxruntime", "openvino", "tensorrt"], help="default: the target's first")
    p.add_argument(
        "--int8-flavour",
        choices=["qdq", "dynamic", "nncf", "weights", "calibrator"],
        help="how INT8 is made (default: qdq for ONNX Runtime/TensorRT, nncf for OpenVINO)",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="calibration manifest, or a capture directory ([calibration] capture_dir) (default: the recipe's)",
    )
    p.add_argument("--method", choices=["minmax", "entropy", "percentile"])
    p.set_defaults(func=cmd_build)

    p = subparsers.add_parser("engines", help="the engine cache")
    esub = p.add_subparsers(dest="engines_command", metavar="ACTION", required=True)
    q = esub.add_parser("list", help="cached engines: accuracy, gate verdict, whether current, chosen and served")
    _common(q)
    q.set_defaults(func=cmd_engines_list)
    q = esub.add_parser("verify", help="re-hash every engine; quarantine the ones that changed")
    _common(q)
    q.set_defaults(func=cmd_engines_verify)
    q = esub.add_parser(
        "prune",
        help="remove stale (other runtime/device) and quarantined engines, refused "
        "builds and locks no build holds; evict to the cap",
    )
    _common(q)
    q.add_argument("--all", action="store_true", help="remove every engine and unfinished build")
    q.set_defaults(func=cmd_engines_prune)
    q = esub.add_parser(
        "convert",
        help="write the in-place KV folder (GroupQueryAttention, genai_config.json) of a plain Phi-3/Gemma export",
    )
    _common(q)
    q.add_argument("--inplace-kv", action="store_true", required=True, help="the conversion to run (the only one)")
    q.add_argument("src", help="demo model name or plain export folder (model.onnx, config.json, tokenizer)")
    q.add_argument("dst", type=Path, help="the folder to write (replaced)")
    q.add_argument("--check-tokens", type=int, default=16, help="decode steps compared with the source (0: no check)")
    q.add_argument("--threads", type=int, default=1, help="intra-op threads for the check")
    q.set_defaults(func=cmd_engines_convert)


def cmd_engines_convert(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..engines.inplace_kv import convert_inplace
    from ..models.catalog import resolve_model

    settings = load_settings(args.config)
    src = resolve_model(args.src, settings.models.cache_dir).path
    report = convert_inplace(src, args.dst, check_tokens=args.check_tokens, threads=args.threads)
    check = report.get("check")
    verdict = (
        f"logits within {check['max_rel_diff']:.1e} of the logit scale, greedy equal for {check['tokens']} steps"
        if check
        else "not checked"
    )
    emit(args, {**report, "dst": str(args.dst)}, f"wrote {args.dst} ({report['family']}, in-place KV): {verdict}")
    return 0


# -- helpers -------------------------------------------------------------------------------------


def _setup(args: argparse.Namespace):
    from ..engines.pipeline import Heartbeat, Pipeline
    from ..engines.recipes import load_recipe

    settings, cache = open_cache(args)
    if getattr(args, "target", "") is None:
        args.target = this_target(settings.device.target)
    recipe = load_recipe(args.recipe, settings.engines.recipes_dir)
    threads = args.threads if args.threads is not None else (settings.device.threads or 1)
    pipe = Pipeline(recipe, cache, settings.models.cache_dir, threads, Heartbeat(enabled=not args.quiet))
    return settings, cache, pipe


_emit = emit


def _attempt(pipe, req) -> tuple[dict, bool]:
    from ..engines.pipeline import GateRefused

    try:
        return pipe.build(req), True
    except GateRefused as exc:
        return exc.report, False


def _report(args: argparse.Namespace, pipe, reports: list[dict], skipped: list[dict], **extra: Any) -> dict:
    from ..engines.report import decide, render

    summary = decide(reports, pipe.recipe.workload, args.target, skipped)
    summary.update(recipe=pipe.recipe.name, target=args.target, **extra)
    if args.plot is not None:
        from .engine_plot import plot_decision

        summary["plot"] = str(plot_decision(summary, pipe.recipe.workload, args.plot))
    _emit(args, summary, render(summary, pipe.recipe.workload))
    return summary


def _attempts(pipe, requests, reports: list[dict]) -> None:
    """Run each build in turn; on Ctrl-C say what stays staged and that the same command resumes."""
    from ..engines.cache import STEPS, cache_key, staged_steps

    for req in requests:
        try:
            report, _ = _attempt(pipe, req)
        except KeyboardInterrupt:
            staged = pipe.cache.staging_dir / cache_key(pipe.key_parts(req))
            done = staged_steps(staged) if staged.is_dir() else []
            name = f"{pipe.backend_for(req)}/{req.precision}" + (f" {req.flavour}" if req.flavour else "")
            print(
                f"edge-agent: interrupted: {len(done)} of {len(STEPS)} steps of {name} are staged"
                + (f" ({', '.join(done)}) in {staged}" if done else "")
                + f"; {len(reports)} candidate(s) finished before it are cached or judged; "
                "run the same command to resume",
                file=sys.stderr,
            )
            raise _Interrupted from None
        reports.append(report)


class _Interrupted(Exception):
    """Ctrl-C during a build, already reported."""


# -- commands ------------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    from ..engines.machine_build import plan

    _, _, pipe = _setup(args)
    requests, skipped = plan(
        pipe,
        args.target,
        args.precision,
        args.backend,
        args.int8_flavour,
        args.data,
        args.method,
        args.force,
    )
    reports: list[dict] = []
    try:
        _attempts(pipe, requests, reports)
    except _Interrupted:
        return EXIT_INTERRUPTED
    summary = _report(args, pipe, reports, skipped)
    refused = [r["candidate"] for r in summary["rows"] if not r["passed"]]
    if not any(r.get("cache") in ("built", "hit") for r in reports):
        print(
            f"edge-agent: every candidate was refused by the accuracy gate: {', '.join(refused)} "
            "(see the report above); nothing was cached",
            file=sys.stderr,
        )
        return EXIT_ALL_REFUSED
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..backends import is_installed
    from ..engines.pipeline import INT8_FLAVOURS, BuildRequest
    from ..engines.recipes import TARGET_BACKENDS
    from ..engines.tensorrt_build import is_strongly_typed_only

    _, _, pipe = _setup(args)
    if "int8" not in pipe.recipe.precisions:
        raise InputError(f"recipe {pipe.recipe.name} lists no int8 precision; nothing to calibrate")
    t0 = time.perf_counter()
    requests, skipped = [], []
    for backend in TARGET_BACKENDS[args.target]:
        if not is_installed(backend):
            skipped.append({"candidate": f"{backend}/int8", "why": f"{backend} is not installed here"})
            continue
        for flavour in INT8_FLAVOURS[backend]:
            if flavour == "weights" and pipe.recipe.workload != "llm":
                continue
            if flavour == "calibrator":
                from ..engines.fingerprint import runtime_version

                if is_strongly_typed_only(runtime_version("tensorrt") or "11"):
                    continue  # TensorRT 11 removed the implicit calibrator: Q/DQ only
            requests.append(BuildRequest(args.target, "int8", backend, flavour, args.data, args.method, args.force))
    if not requests:
        raise InputError(
            f"no runtime for target {args.target} is installed here ({'; '.join(s['why'] for s in skipped)})"
        )
    reports: list[dict] = []
    try:
        _attempts(pipe, requests, reports)
    except _Interrupted:
        return EXIT_INTERRUPTED
    data = pipe.calibration_path(BuildRequest(args.target, "int8", data=args.data))
    _report(args, pipe, reports, skipped, calibration_data=str(data), seconds=round(time.perf_counter() - t0, 2))
    if not any(r.get("cache") in ("built", "hit") for r in reports):
        print(
            f"edge-agent: every INT8 candidate of {pipe.recipe.name} was refused by the accuracy gate "
            "(see the report above); nothing was cached",
            file=sys.stderr,
        )
        return EXIT_ALL_REFUSED
    return 0
