"""``edge-agent engines list`` marks each rung's choice: the top rung's (``chosen``: what a tier serves by
default) among engines within the recipe's [accuracy], a lower rung's (``chosen (lower)``) among those
within that rung's budget. An engine within only the lower rung is never the top rung's choice, however
fast it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from edge_agent.engines.cache import EngineCache
from edge_agent.engines.fingerprint import device_fingerprint, runtime_version

ROOT = Path(__file__).resolve().parents[2]


def _commit(cache: EngineCache, key: str, precision: str, latency_ms: float, rungs: dict[str, bool]) -> None:
    with cache.staging(key) as staged:
        (staged / "model").mkdir(parents=True, exist_ok=True)
        (staged / "model" / "model.onnx").write_bytes(precision.encode())
        manifest = {
            "artifact": "model",
            "recipe_name": "home",
            "model_name": "home",
            "workload": "llm",
            "target": "cpu",
            "backend": "onnxruntime",
            "runtime": "onnxruntime",
            "runtime_version": runtime_version("onnxruntime"),
            "device": device_fingerprint("cpu"),
            "precision": precision,
            "key_parts": {"model": "m" * 64},
            "accuracy": {
                "passed": any(rungs.values()),
                "rungs": rungs,
                "metrics": {"cosine": 0.99, "top1": 0.9, "kl": 0.01},
                "latency_ms": latency_ms,
                "reference_latency_ms": 30.0,
            },
        }
        cache.commit(key, staged, manifest)


def test_each_rungs_choice_is_marked_and_a_lower_rung_engine_is_never_the_top_choice(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 1 << 30)
    _commit(cache, "a" * 64, "fp32", 30.0, {"top": True, "lower": True})
    _commit(cache, "b" * 64, "int8w", 15.0, {"top": True, "lower": True})
    _commit(cache, "c" * 64, "int4", 10.0, {"top": False, "lower": True})  # the fastest, within lower only
    env = {**os.environ, "EDGE_AGENT_ENGINES__CACHE_DIR": str(tmp_path / "engines")}
    out = subprocess.run(
        [sys.executable, "-m", "edge_agent", "engines", "list", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["precision"]: r for r in json.loads(out.stdout)["engines"]}
    assert {p: (r["chosen"], r["chosen_rungs"]) for p, r in rows.items()} == {
        "fp32": (False, []),
        "int8w": (True, ["top"]),
        "int4": (False, ["lower"]),
    }
    text = subprocess.run(
        [sys.executable, "-m", "edge_agent", "engines", "list"], cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout
    assert "chosen (lower)" in text
