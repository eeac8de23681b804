"""``edge-agent calibrate`` / ``build`` / ``engines`` as a user runs them (subprocess, real runtimes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_agent.engines.serving_mark import record_serving
from tests.integration.test_build_onnxruntime import make_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(tmp_path: Path):
    env = {
        **os.environ,
        "EDGE_AGENT_ENGINES__CACHE_DIR": str(tmp_path / "engines"),
        "EDGE_AGENT_MODELS__CACHE_DIR": str(tmp_path / "models"),
        "EDGE_AGENT_DEVICE__THREADS": "1",
    }

    def go(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "edge_agent", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
        )

    return go


@pytest.mark.slow
def test_calibrate_reports_every_int8_flavour_and_a_choice(tmp_path: Path, run) -> None:
    recipe = make_recipe(tmp_path)
    done = run("calibrate", "--recipe", str(recipe), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    flavours = {(e["backend"], e["flavour"]) for e in report["engines"]}
    assert {("onnxruntime", "qdq"), ("onnxruntime", "dynamic")} <= flavours
    if not any(s["candidate"].startswith("openvino/") for s in report["skipped"]):
        assert ("openvino", "nncf") in flavours
    assert report["table"][0]["flavour"] == "source"  # FP32 itself is a candidate: INT8 must beat it
    assert report["chosen"] is not None
    assert report["verdict"].startswith("chosen: ")
    for row in report["rows"]:  # calibration time only where calibration ran; a reason wherever not chosen
        if row["flavour"] in ("dynamic", "weights", "source"):
            assert row["calibration_s"] is None, row
        assert row["chosen"] or row["why_not_chosen"], row
    assert report["seconds"] > 0
    assert "calibrating" in done.stderr or "calibration inputs" in done.stderr  # progress on stderr


def test_build_engines_list_verify_prune(tmp_path: Path, run) -> None:
    recipe = make_recipe(tmp_path)
    out = tmp_path / "report.json"
    done = run("build", "--recipe", str(recipe), "--target", "cpu", "--precision", "fp32", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "onnxruntime/fp32" in done.stdout  # the table still prints when the JSON goes to a file
    built = json.loads(out.read_text())["engines"][0]
    assert built["cache"] == "built"

    listing = json.loads(run("engines", "list", "--json").stdout)
    [entry] = listing["engines"]
    assert entry["key"] == built["key"] and entry["status"] == "current"
    assert entry["chosen"] and entry["gate"] == "PASS" and entry["serving"] == []
    assert entry["metrics"]["cosine"] == built["accuracy"]["metrics"]["cosine"]

    # A daemon records what it serves in the cache; the mark lives only as long as that process.
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record_serving(tmp_path / "engines", "full", built["key"], pid=daemon.pid)
        listed = run("engines", "list")
        assert "serving (full)" in listed.stdout and "chosen" in listed.stdout
        assert json.loads(run("engines", "list", "--json").stdout)["engines"][0]["serving"] == ["full"]
    finally:
        daemon.kill()
        daemon.wait(timeout=30)
    assert json.loads(run("engines", "list", "--json").stdout)["engines"][0]["serving"] == []

    assert run("engines", "verify").returncode == 0
    graph = Path(built["path"]) / "model" / "model.onnx"
    graph.write_bytes(b"garbage")
    bad = run("engines", "verify")
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and "quarantined" in bad.stderr
    assert json.loads(run("engines", "list", "--json").stdout)["engines"] == []

    pruned = json.loads(run("engines", "prune", "--json").stdout)
    assert len(pruned["removed"]["quarantine"]) == 1


@pytest.mark.slow
def test_errors_are_one_line(tmp_path: Path, run) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    recipe = make_recipe(tmp_path, calib=empty)
    done = run("build", "--recipe", str(recipe), "--target", "cpu", "--precision", "int8")
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        "the manifest is empty; calibration needs representative samples (see calibration/README.md)"
    )
    assert "Traceback" not in done.stderr

    done = run("build", "--recipe", str(recipe), "--target", "jetson", "--precision", "fp16")
    assert done.returncode == 1 and "TensorRT comes from JetPack" in done.stderr

    done = run("build", "--recipe", "no-such-recipe", "--target", "cpu", "--precision", "fp32")
    assert done.returncode == 2 and "recipe file not found" in done.stderr


@pytest.mark.slow
def test_build_defaults_to_this_machine_and_every_precision_with_exit_codes(tmp_path: Path, run) -> None:
    # No --target / --precision: this machine (no Jetson, no NPU here: cpu) and every precision listed.
    done = run("build", "--recipe", str(make_recipe(tmp_path)), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["target"] == "cpu"
    assert {e["precision"] for e in report["engines"]} >= {"fp32", "fp16"}
    assert any(e.get("cache") == "built" for e in report["engines"])

    # A budget nothing can meet: every candidate refused is its own exit status, not an error's.
    strict = tmp_path / "strict"
    strict.mkdir()
    done = run("build", "--recipe", str(make_recipe(strict, min_cosine=0.99999999)), "--precision", "int8")
    cached = json.loads(run("engines", "list", "--json").stdout)["engines"]
    if done.returncode == 0:  # INT8 this exact is possible in principle; then it must really be cached
        assert any(e["precision"] == "int8" for e in cached)
        return
    assert done.returncode == 3, done.stderr
    assert "every candidate was refused" in done.stderr and "Traceback" not in done.stderr
    assert "chosen: none" in done.stdout

    # The refused build stays in staging until prune, which says what it removed.
    staging = tmp_path / "engines" / "staging"
    refused = [p for p in staging.iterdir() if p.is_dir()]
    assert refused
    pruned = run("engines", "prune", "--json")
    removed = json.loads(pruned.stdout)
    assert sorted(removed["removed"]["staging"]) == sorted(p.name for p in refused)
    assert not any(p.exists() for p in refused) and not list(staging.glob("*.lock"))

    # calibrate follows the same rule: every INT8 candidate refused is 3, not an error's 1.
    done = run("calibrate", "--recipe", str(make_recipe(strict, min_cosine=0.99999999)))
    assert done.returncode in (0, 3), done.stderr
    if done.returncode == 3:
        assert "was refused by the accuracy gate" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_ctrl_c_says_what_is_staged_and_the_same_command_resumes(tmp_path: Path, run) -> None:
    env = {
        **os.environ,
        "EDGE_AGENT_ENGINES__CACHE_DIR": str(tmp_path / "engines"),
        "EDGE_AGENT_MODELS__CACHE_DIR": str(tmp_path / "models"),
        "EDGE_AGENT_DEVICE__THREADS": "1",
    }
    args = ["build", "--recipe", "demo-asr", "--precision", "int8", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_agent", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it, even when this test runs in a background job (which ignores SIGINT
        # and would pass that on to the build)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if list((tmp_path / "engines" / "staging").glob("*/steps/reference.json")):
            break
        time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail("the build never finished its reference step")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    found = re.search(r"interrupted: (\d) of 4 steps of onnxruntime/int8 are staged", err)
    assert found and int(found.group(1)) >= 1, err
    assert "run the same command to resume" in err and "Traceback" not in err

    again = run(*args)
    assert again.returncode in (0, 3), again.stderr
    [engine] = json.loads(again.stdout)["engines"]
    assert "reference" in engine["resumed_steps"]
