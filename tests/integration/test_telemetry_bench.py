from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_bench_telemetry_runs_every_condition_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "bench",
            "telemetry",
            "--model",
            "demo-phi3",
            "--requests",
            "4",
            "--rounds",
            "1",
            "--max-new-tokens",
            "4",
            "--prompt-tokens",
            "8",
            "--interval-s",
            "0.05",
            "--delay-ms",
            "50",
            "--quiet",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"off", "up", "down", "slow"}
    assert report["median"]["off"]["e2e_p99_ratio"] == 1.0
    assert all(m["e2e_p99"] > 0 for m in report["median"].values())
    assert report["median"]["up"]["published"] > 0 and report["median"]["down"]["published"] == 0
    assert "p99 vs off" in proc.stdout


def test_bench_telemetry_refuses_bad_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "edge_agent", "bench", "telemetry", "--conditions", "up"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "include 'off'" in proc.stderr and "Traceback" not in proc.stderr
