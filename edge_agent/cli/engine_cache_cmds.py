"""``edge-agent engines list|verify|prune``: the engine cache as a field engineer reads and tidies it.

``list`` shows each engine's accuracy against its budget, the gate's verdict, whether it is the one
the daemon's resolver picks for its model, target and backend (``chosen``), and whether a running
daemon serves it (from the daemon's own record in the cache, ``serving.json``). ``prune`` says what
it removed, with paths.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import EdgeAgentError
from .engine_io import emit as _emit
from .engine_io import open_cache

if TYPE_CHECKING:
    from ..engines.cache import EngineCache, Entry
    from ..engines.gate import Verdict


def _setup(args: argparse.Namespace):
    settings, cache = open_cache(args)
    return settings, cache, None


def cmd_engines_list(args: argparse.Namespace) -> int:
    from ..engines.fingerprint import device_fingerprint, runtime_versions
    from ..engines.serving_mark import served_keys

    _, cache, _ = _setup(args)
    versions = runtime_versions()
    devices: dict[str, str] = {}
    served = served_keys(cache.root)
    rows: list[dict[str, Any]] = []
    groups: dict[tuple, list[tuple[str, Verdict]]] = {}
    for e in cache.entries():
        m = e.manifest
        target = m.get("target", "cpu")
        if target not in devices:
            devices[target] = device_fingerprint(target)
        current = versions.get(m.get("runtime")) == m.get("runtime_version") and devices[target] == m.get("device")
        verdict = _verdict(m)
        if current:  # what the daemon's resolver picks among: one model, target and backend, current entries
            group = (m.get("model_name"), (m.get("key_parts") or {}).get("model"), target, m.get("backend"))
            groups.setdefault(group, []).append((e.key, verdict))
        rows.append(_row(e, target, current, verdict, served.get(e.key, [])))
    _mark_chosen(groups, rows)
    total = sum(r["bytes"] for r in rows)
    _emit(
        args,
        {"cache_dir": str(cache.root), "max_bytes": cache.max_bytes, "total_bytes": total, "engines": rows},
        _table(rows, total, cache),
    )
    return 0


def _verdict(m: dict[str, Any]) -> Verdict:
    """The gate's ``Verdict`` as the manifest recorded it."""
    from ..engines.gate import Verdict

    acc = m.get("accuracy") or {}
    return Verdict(
        str(m.get("precision")),
        str(m.get("backend")),
        acc.get("metrics") or {},
        acc.get("budget") or {},
        bool(acc.get("passed", True)),
        acc.get("reasons") or [],
        acc.get("latency_ms"),
        acc.get("reference_latency_ms"),
        str(m.get("flavour") or ""),
        rungs=dict(acc.get("rungs") or {}),
        weight_bytes=acc.get("weight_bytes"),
    )


def _row(e: Entry, target: str, current: bool, verdict: Verdict, serving: list) -> dict[str, Any]:
    """One engine's row (``chosen`` filled in later, over its group)."""
    from ..engines.report import checks

    m = e.manifest
    acc = m.get("accuracy") or {}
    workload = m.get("workload") or ("llm" if "cosine" in verdict.metrics else "asr")
    return {
        "key": e.key,
        "recipe": m.get("recipe_name"),
        "model": m.get("model_name"),
        "target": target,
        "backend": m.get("backend"),
        "precision": m.get("precision"),
        "flavour": m.get("flavour"),
        "bytes": e.size_bytes,
        "last_used": e.last_used,
        "status": "current" if current else "stale",
        "latency_ms": acc.get("latency_ms"),
        "reference_latency_ms": acc.get("reference_latency_ms"),
        "speedup": verdict.speedup,
        "metrics": verdict.metrics,
        "budget": verdict.budget,
        "accuracy": checks(verdict, workload) if verdict.metrics else {},
        "gate": "PASS" if verdict.passed else "REFUSED",
        "chosen": False,
        "chosen_rungs": [],
        "serving": serving,
        "path": str(e.path),
    }


def _mark_chosen(groups: dict[tuple, list[tuple[str, Verdict]]], rows: list[dict[str, Any]]) -> None:
    """Each rung's choice in each group: the top rung's is ``chosen``, a lower one's is named in ``chosen_rungs``."""
    from ..engines.gate import choose
    from ..engines.recipes import TOP_RUNG

    for members in groups.values():
        rungs = [TOP_RUNG, *sorted({r for _, v in members for r in v.rungs} - {TOP_RUNG})]
        for rung in rungs:
            best = choose([v for _, v in members], rung)
            for key, v in members:
                if v is best:
                    row = next(r for r in rows if r["key"] == key)
                    row["chosen_rungs"].append(rung)
                    row["chosen"] = row["chosen"] or rung == TOP_RUNG


def _table(rows: list[dict[str, Any]], total: int, cache: EngineCache) -> str:
    """The rows as the text table, with a closing line of totals and what the marks mean."""
    from ..engines.recipes import TOP_RUNG

    lines = [
        f"{'KEY':<13} {'RECIPE':<18} {'ENGINE':<24} {'ACCURACY':<56} {'GATE':<5} {'speed':>6} {'MB':>7} "
        f"{'STATUS':<8} MARK"
    ]
    for r in rows:
        engine = f"{r['backend']}/{r['precision']}" + (f" {r['flavour']}" if r["flavour"] else "")
        accuracy = ", ".join(f"{k} {v}" for k, v in r["accuracy"].items()) or "-"
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        chosen = [f"chosen ({rung})" if rung != TOP_RUNG else "chosen" for rung in r["chosen_rungs"]]
        mark = ", ".join(chosen + [f"serving ({t})" for t in r["serving"]])
        lines.append(
            f"{r['key'][:12]:<13} {r['recipe']!s:<18} {engine:<24} {accuracy:<56} {r['gate']:<5} {speed:>6} "
            f"{r['bytes'] / 1e6:7.1f} {r['status']:<8} {mark}"
        )
    lines.append(
        f"{len(rows)} engine(s), {total / 1e6:.1f} MB of {cache.max_bytes / 1e6:.0f} MB in {cache.root}; "
        "chosen: what the daemon's resolver picks for its model, target and backend; serving: a running "
        "daemon serves it (its own record in serving.json)"
    )
    return "\n".join(lines)


def cmd_engines_verify(args: argparse.Namespace) -> int:
    _, cache, _ = _setup(args)
    results = []
    for e in cache.entries():
        problems = cache.verify_entry(e.path)
        moved = str(cache.quarantine(e.key, "; ".join(problems))) if problems else None
        results.append(
            {
                "key": e.key,
                "recipe": e.manifest.get("recipe_name"),
                "ok": not problems,
                "problems": problems,
                "quarantined_to": moved,
            }
        )
    bad = [r for r in results if not r["ok"]]
    text = (
        "\n".join(
            f"{r['key'][:12]} {r['recipe']}: "
            + ("ok" if r["ok"] else "BAD (" + "; ".join(r["problems"]) + ") -> quarantined; the next build rebuilds it")
            for r in results
        )
        or "no engines cached"
    )
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
    labels = {
        "all": "engines",
        "stale": "stale engines",
        "quarantine": "quarantined",
        "evicted": "evicted",
        "staging": "refused builds (staging)" if not args.all else "builds (staging)",
        "locks": "stale locks",
    }
    lines = [
        f"removed from {cache.root}: "
        + ", ".join(f"{labels[k]} {len(v)}" for k, v in removed.items() if k != "all" or args.all)
    ]
    folder = {
        "stale": cache.entries_dir,
        "all": cache.entries_dir,
        "evicted": cache.entries_dir,
        "quarantine": cache.quarantine_dir,
        "staging": cache.staging_dir,
        "locks": cache.staging_dir,
    }
    paths = {k: [str(folder[k] / name) for name in v] for k, v in removed.items()}
    lines += [f"  {p}" for v in paths.values() for p in v]
    _emit(args, {"removed": removed, "paths": paths, "cache_dir": str(cache.root)}, "\n".join(lines))
    return 0
