"""The command line as a user runs it: a subprocess, its exit code, stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "edge_agent", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def test_help_lists_the_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("check-config", "doctor", "models", "generate"):
        assert command in out.stdout


def test_check_config_accepts_the_example_once_its_model_is_fetched(tmp_path):
    import shutil

    example = str(REPO / "systemd" / "agent.toml")
    env = {"EDGE_AGENT_MODELS__CACHE_DIR": str(tmp_path / "models")}
    out = run_cli("check-config", "--config", example, env=env)
    assert out.returncode == 2  # its Gemma 3 tiers and Whisper base: fetched once, and check-config says how
    assert out.stdout.count("get it with `edge-agent models fetch gemma-3-270m-home`") == 2, out.stdout
    assert out.stdout.count("get it with `edge-agent models fetch whisper-base`") == 1, out.stdout
    # an LLM folder and a Whisper import where `models fetch` puts them
    shutil.copytree(
        REPO / "tests" / "data" / "phi3-optimum-tiny", tmp_path / "models" / "imported" / "gemma-3-270m-home"
    )
    from edge_agent.importers import import_model
    from tests import ct2_whisper_tiny

    ct2_whisper_tiny.write_folder(tmp_path / "ct2", "float32")
    import_model(tmp_path / "ct2", tmp_path / "models" / "imported" / "whisper-base", tmp_path / "models")
    out = run_cli("check-config", "--config", example, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "configuration OK" in out.stdout


def test_run_without_the_default_model_says_in_one_line_how_to_get_it(tmp_path):
    cfg = tmp_path / "agent.toml"  # the built-in tiers; only the daemon's ports and files are set
    cfg.write_text(
        f'[api]\nport = 0\n[mqtt]\nport = 1\n[telemetry]\nspool_path = "{tmp_path / "spool.sqlite"}"\n'
        f'ledger_path = "{tmp_path / "ledger.sqlite"}"\n'
    )
    env = {"CACHE_DIRECTORY": str(tmp_path / "cache"), "STATE_DIRECTORY": str(tmp_path / "state")}
    out = run_cli("run", "--config", str(cfg), env=env)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "edge-agent: no LLM tier could be loaded: full, short: model 'gemma-3-270m-home' is not here yet: "
        "get it with `edge-agent models fetch gemma-3-270m-home`"
    ), out.stderr[-2000:]


def test_check_config_prints_every_problem_and_exits_nonzero(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(
        '[mqtt]\nport = 0\nhots = 1\n[[models.llm]]\nname = "x"\nmodel = "no-such-model"\n'
        '[[models.asr]]\nname = "y"\nmodel = "demo-phi3"\n'
    )
    out = run_cli("check-config", "--config", str(cfg))
    assert out.returncode == 2
    lines = out.stdout.splitlines()
    assert any(line.startswith("mqtt.port: ") for line in lines)
    assert "mqtt.hots: unknown key; did you mean 'host'?" in lines
    # One pass: the tiers' models are checked although the schema failed.
    assert any(line.startswith("models.llm[0].model: no model 'no-such-model'") for line in lines)
    assert "models.asr[0].model: 'demo-phi3' is a llm model, not asr" in lines
    cfg.write_text(
        '[[models.llm]]\nname = "x"\nmodel = "no-such-model"\n[[models.asr]]\nname = "y"\nmodel = "demo-phi3"\n'
    )
    out = run_cli("check-config", "--config", str(cfg), "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 2 and report["ok"] is False
    paths = {p["path"]: p["message"] for p in report["problems"]}
    assert "no-such-model" in paths["models.llm[0].model"]
    assert "llm model, not asr" in paths["models.asr[0].model"]


def test_check_config_env_problems_are_reported(tmp_path):
    out = run_cli("check-config", env={"EDGE_AGENT_MQTT__PORT": "not-a-port"})
    assert out.returncode == 2
    assert out.stdout.startswith("mqtt.port: ")


def test_missing_config_file_is_one_line_on_stderr(tmp_path):
    out = run_cli("models", "list", "--config", str(tmp_path / "absent.toml"))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "config file not found" in out.stderr
    assert "Traceback" not in out.stderr


def test_models_list_json_names_every_demo_model():
    out = run_cli("models", "list", "--json")
    assert out.returncode == 0, out.stderr
    names = {m["name"] for m in json.loads(out.stdout)["demo_models"]}
    assert {"demo-phi3", "demo-gemma", "demo-gemma2", "demo-phi3-small", "demo-whisper", "demo-ctc"} <= names


@pytest.mark.parametrize(
    "model, message",
    [
        ("no-such-model", "no model 'no-such-model'"),
    ],
)
def test_generate_with_an_unknown_model_is_a_clear_error(model, message):
    out = run_cli("generate", "--model", model, "hello")
    assert out.returncode == 1
    assert message in out.stderr and "Traceback" not in out.stderr


def test_generate_json_fields_and_reproducible_seeded_sampling():
    runs = [
        run_cli("generate", "--model", "demo-phi3", "--json", "--seed", "11", "--max-new-tokens", "12", "Hello")
        for _ in range(2)
    ]
    for out in runs:
        assert out.returncode == 0, out.stderr
    a, b = (json.loads(out.stdout) for out in runs)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert len(a["token_ids"]) == a["new_tokens"] <= 12
    assert 0 < a["ttft_ms"] <= a["e2e_ms"]
    assert a["finish_reason"] in ("length", "stop")


def test_generate_streams_text_then_a_latency_line():
    out = run_cli("generate", "--model", "demo-gemma", "--greedy", "--max-new-tokens", "8", "Hi")
    assert out.returncode == 0, out.stderr
    assert "TTFT" in out.stderr and "demo-gemma" in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "0"], "top_p must lie in (0, 1]"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--max-new-tokens", "100000"], "exceeds the model's context"),
    ],
)
def test_generate_bad_parameters_are_one_line_errors(args, message):
    out = run_cli("generate", "--model", "demo-phi3", *args, "hello")
    assert out.returncode == 1
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
