"""``edge-agent calibrate``, ``edge-agent build`` and ``edge-agent engines list|verify|prune``.

``--json`` prints the report as one JSON object on stdout, or writes it to the file given
(``--json report.json``). Progress with ETA goes to stderr; under systemd the build keeps the
service's start timeout extended (EXTEND_TIMEOUT_USEC) while it works.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import EdgeAgentError, InputError

PRECISIONS = ("fp32", "fp16", "int8", "int4")
EXIT_ALL_REFUSED = 3  # `build`: every candidate refused by the accuracy gate (distinct from 1, an error)


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", nargs="?", const="-", metavar="OUT",
                   help="print the report as JSON on stdout, or write it to OUT")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    _json_arg(p)


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="recipe file, or a name in engines.recipes_dir (e.g. demo-asr)")
    p.add_argument("--threads", type=int, help="intra-op threads for calibration and measurements (default: config)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache holds a verified engine")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="make the INT8 artifacts of a recipe and gate them against FP32")
    _common(p)
    _recipe_args(p)
    p.add_argument("--data", type=Path, help="calibration manifest (default: the recipe's)")
    p.add_argument("--method", choices=["minmax", "entropy", "percentile"], help="activation range method")
    p.add_argument("--target", choices=["cpu", "jetson", "intel-npu"],
                   help="default: device.target from the config, or this machine (Jetson, Intel NPU, else cpu)")
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser("build", help="build, gate and cache an engine for a target and precision")
    _common(p)
    _recipe_args(p)
    p.add_argument("--target", choices=["cpu", "jetson", "intel-npu"],
                   help="default: device.target from the config, or this machine (Jetson, Intel NPU, else cpu)")
    p.add_argument("--precision", default="all", choices=[*PRECISIONS, "all"],
                   help="default 'all': every precision the recipe lists, then the engine to use is picked. "
                        f"Exit status: 0 an engine passed the gate and is cached, {EXIT_ALL_REFUSED} every "
                        "candidate was refused by the gate, 1 an error, 2 bad usage or config")
    p.add_argument("--backend", choices=["onnxruntime", "openvino", "tensorrt"], help="default: the target's first")
    p.add_argument("--int8-flavour", choices=["qdq", "dynamic", "nncf", "weights", "calibrator"],
                   help="how INT8 is made (default: qdq for ONNX Runtime/TensorRT, nncf for OpenVINO)")
    p.add_argument("--data", type=Path, help="calibration manifest (default: the recipe's)")
    p.add_argument("--method", choices=["minmax", "entropy", "percentile"])
    p.set_defaults(func=cmd_build)

    p = subparsers.add_parser("engines", help="the engine cache")
    esub = p.add_subparsers(dest="engines_command", metavar="ACTION", required=True)
    q = esub.add_parser("list", help="cached engines, their accuracy and whether they are current")
    _common(q)
    q.set_defaults(func=cmd_engines_list)
    q = esub.add_parser("verify", help="re-hash every engine; quarantine the ones that changed")
    _common(q)
    q.set_defaults(func=cmd_engines_verify)
    q = esub.add_parser("prune", help="remove stale (other runtime/device) and quarantined engines; evict to the cap")
    _common(q)
    q.add_argument("--all", action="store_true", help="remove every engine and unfinished build")
    q.set_defaults(func=cmd_engines_prune)


# -- helpers -------------------------------------------------------------------------------------

def _setup(args: argparse.Namespace):
    from ..config import load_settings
    from ..engines.cache import EngineCache
    from ..engines.pipeline import Heartbeat, Pipeline
    from ..engines.recipes import load_recipe

    settings = load_settings(args.config)
    if getattr(args, "target", "") is None:
        args.target = default_target(settings.device.target)
    cache = EngineCache(settings.engines.cache_dir, settings.engines.max_bytes)
    if not hasattr(args, "recipe"):
        return settings, cache, None
    recipe = load_recipe(args.recipe, settings.engines.recipes_dir)
    threads = args.threads if args.threads is not None else (settings.device.threads or 1)
    pipe = Pipeline(recipe, cache, settings.models.cache_dir, threads, Heartbeat(enabled=not args.quiet))
    return settings, cache, pipe


def _emit(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    if args.json in (None, ""):
        print(text)
        return
    if args.json == "-":
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(text)


def _attempt(pipe, req) -> tuple[dict, bool]:
    from ..engines.pipeline import GateRefused

    try:
        return pipe.build(req), True
    except GateRefused as exc:
        return exc.report, False


def _summary(reports: list[dict], workload: str, with_source: bool = True) -> tuple[dict, str]:
    from ..engines import gate
    from ..engines.pipeline import verdict_from

    verdicts = [verdict_from(r) for r in reports if r.get("accuracy")]
    if with_source:
        verdicts = source_verdicts(verdicts, workload) + verdicts
    chosen = gate.choose(verdicts)
    table = gate.render_table(verdicts, workload, chosen)
    lines = [table]
    for r in reports:
        where = f"{r.get('cache')} {r.get('key', '')[:12]}" if r.get("cache") else "refused (not cached)"
        conv = r.get("conversion") or {}
        lines.append(f"  {r['backend']}/{r['precision']}{(' ' + r['flavour']) if r.get('flavour') else ''}: {where}; "
                     f"build {r.get('build_s')} s" + (f", calibration {conv['seconds']} s" if 'seconds' in conv else "")
                     + (f", load {r['load_ms']} ms" if r.get("load_ms") is not None else ""))
    summary = {"chosen": chosen.to_dict() if chosen else None, "engines": reports,
               "table": [v.to_dict() for v in verdicts]}
    return summary, "\n".join(lines)


def source_verdicts(verdicts: list, workload: str) -> list:
    """The FP32 source model itself as a candidate, once per backend (its latency is the paired reference
    each gate measured), so a quantized engine has to beat it to be chosen."""
    from ..engines.gate import Verdict

    out = []
    for backend in dict.fromkeys(v.backend for v in verdicts):
        mine = [v for v in verdicts if v.backend == backend and v.reference_latency_ms]
        if not mine:
            continue
        lat = sorted(v.reference_latency_ms for v in mine)[len(mine) // 2]
        if workload == "llm":
            metrics = {"cosine": 1.0, "top1": 1.0, "kl": 0.0}
        else:
            wer = mine[0].metrics.get("wer_fp32", 0.0)
            metrics = {"wer": wer, "wer_fp32": wer, "wer_delta": 0.0, "text_agreement": 1.0}
        out.append(Verdict("fp32", backend, metrics, {}, True, [], lat, lat, "source"))
    return out


# -- commands ------------------------------------------------------------------------------------

def cmd_build(args: argparse.Namespace) -> int:
    from ..engines.pipeline import BuildRequest

    _, _, pipe = _setup(args)
    precisions = [p for p in pipe.recipe.precisions] if args.precision == "all" else [args.precision]
    reports, refused = [], []
    for precision in precisions:
        backend = args.backend or pipe.backend_for(BuildRequest(args.target, precision))
        if precision == "int4" and backend != "openvino" and args.precision == "all":
            continue
        req = BuildRequest(args.target, precision, args.backend, args.int8_flavour if precision == "int8" else None,
                           args.data, args.method, args.force)
        report, ok = _attempt(pipe, req)
        reports.append(report)
        if not ok:
            refused.append(f"{report['backend']}/{precision}")
    summary, text = _summary(reports, pipe.recipe.workload)
    summary.update(recipe=pipe.recipe.name, target=args.target)
    _emit(args, summary, text)
    if refused and len(refused) == len(reports):
        print(f"edge-agent: every candidate was refused by the accuracy gate: {', '.join(refused)} "
              "(see the report above); nothing was cached", file=sys.stderr)
        return EXIT_ALL_REFUSED
    if refused:  # some refused, at least one cached: a normal outcome for --precision all
        print(f"edge-agent: refused by the accuracy gate (not cached): {', '.join(refused)}", file=sys.stderr)
    return 0


def default_target(configured: str) -> str:
    """The build target when ``--target`` is not given: the config's ``device.target`` unless it is
    ``auto``, else what this machine is (a Jetson has /etc/nv_tegra_release, an Intel NPU shows up
    as /dev/accel/accel0), else ``cpu``."""
    if configured != "auto":
        return configured
    if Path("/etc/nv_tegra_release").exists():
        return "jetson"
    if Path("/dev/accel/accel0").exists():
        return "intel-npu"
    return "cpu"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..backends import is_installed
    from ..engines.pipeline import INT8_FLAVOURS, BuildRequest
    from ..engines.recipes import TARGET_BACKENDS
    from ..engines.tensorrt_build import is_strongly_typed_only

    _, _, pipe = _setup(args)
    if "int8" not in pipe.recipe.precisions:
        raise InputError(f"recipe {pipe.recipe.name} lists no int8 precision; nothing to calibrate")
    t0 = time.perf_counter()
    reports, skipped = [], []
    for backend in TARGET_BACKENDS[args.target]:
        if not is_installed(backend):
            skipped.append(f"{backend}: not installed")
            continue
        for flavour in INT8_FLAVOURS[backend]:
            if flavour == "weights" and pipe.recipe.workload != "llm":
                continue
            if flavour == "calibrator":
                from ..engines.fingerprint import runtime_version

                if is_strongly_typed_only(runtime_version("tensorrt") or "11"):
                    continue  # TensorRT 11 removed the implicit calibrator: Q/DQ only
            req = BuildRequest(args.target, "int8", backend, flavour, args.data, args.method, args.force)
            report, _ = _attempt(pipe, req)
            reports.append(report)
    if not reports:
        raise InputError(f"no runtime for target {args.target} is installed here ({'; '.join(skipped)})")
    summary, text = _summary(reports, pipe.recipe.workload)
    summary.update(recipe=pipe.recipe.name, target=args.target, skipped=skipped,
                   calibration_data=str(pipe.calibration_path(BuildRequest(args.target, "int8", data=args.data))),
                   seconds=round(time.perf_counter() - t0, 2))
    _emit(args, summary, text + (f"\nskipped: {'; '.join(skipped)}" if skipped else ""))
    if not any(r.get("cache") for r in reports):
        raise EdgeAgentError(f"every INT8 candidate of {pipe.recipe.name} was refused by the accuracy gate "
                             f"(see the report above)")
    return 0


def cmd_engines_list(args: argparse.Namespace) -> int:
    from ..engines.fingerprint import device_fingerprint, runtime_versions

    _, cache, _ = _setup(args)
    versions = runtime_versions()
    devices: dict[str, str] = {}
    rows = []
    for e in cache.entries():
        m = e.manifest
        target = m.get("target", "cpu")
        if target not in devices:
            devices[target] = device_fingerprint(target)
        current = versions.get(m.get("runtime")) == m.get("runtime_version") and devices[target] == m.get("device")
        acc = m.get("accuracy") or {}
        rows.append({"key": e.key, "recipe": m.get("recipe_name"), "target": target, "backend": m.get("backend"),
                     "precision": m.get("precision"), "flavour": m.get("flavour"), "bytes": e.size_bytes,
                     "last_used": e.last_used, "status": "current" if current else "stale",
                     "latency_ms": acc.get("latency_ms"), "metrics": acc.get("metrics"), "path": str(e.path)})
    lines = [f"{'KEY':<13} {'RECIPE':<18} {'TARGET':<9} {'ENGINE':<24} {'MB':>8} {'ms':>8} {'STATUS':<8} LAST USED"]
    for r in rows:
        engine = f"{r['backend']}/{r['precision']}" + (f" {r['flavour']}" if r["flavour"] else "")
        ms = f"{r['latency_ms']:.2f}" if r["latency_ms"] is not None else "-"
        lines.append(f"{r['key'][:12]:<13} {r['recipe']!s:<18} {r['target']:<9} {engine:<24} {r['bytes'] / 1e6:8.1f} "
                     f"{ms:>8} {r['status']:<8} {time.strftime('%Y-%m-%d %H:%M', time.localtime(r['last_used']))}")
    total = sum(r["bytes"] for r in rows)
    lines.append(f"{len(rows)} engine(s), {total / 1e6:.1f} MB of {cache.max_bytes / 1e6:.0f} MB in {cache.root}")
    _emit(args, {"cache_dir": str(cache.root), "max_bytes": cache.max_bytes, "total_bytes": total, "engines": rows},
          "\n".join(lines))
    return 0


def cmd_engines_verify(args: argparse.Namespace) -> int:
    _, cache, _ = _setup(args)
    results = []
    for e in cache.entries():
        problems = cache.verify_entry(e.path)
        moved = str(cache.quarantine(e.key, "; ".join(problems))) if problems else None
        results.append({"key": e.key, "recipe": e.manifest.get("recipe_name"), "ok": not problems,
                        "problems": problems, "quarantined_to": moved})
    bad = [r for r in results if not r["ok"]]
    text = "\n".join(f"{r['key'][:12]} {r['recipe']}: " + ("ok" if r["ok"] else "BAD (" + "; ".join(r["problems"])
                     + ") -> quarantined; the next build rebuilds it") for r in results) or "no engines cached"
    _emit(args, {"engines": results, "bad": len(bad)}, text)
    if bad:
        raise EdgeAgentError(f"{len(bad)} engine(s) failed verification and were quarantined")
    return 0


def cmd_engines_prune(args: argparse.Namespace) -> int:
    from ..engines.fingerprint import device_fingerprint, runtime_versions

    _, cache, _ = _setup(args)
    versions = runtime_versions()
    targets = {e.manifest.get("target", "cpu") for e in cache.entries()}
    removed = cache.prune(versions, {t: device_fingerprint(t) for t in targets}, everything=args.all)
    text = ", ".join(f"{k}: {len(v)}" for k, v in removed.items()) + f" removed from {cache.root}"
    _emit(args, {"removed": removed}, text)
    return 0
