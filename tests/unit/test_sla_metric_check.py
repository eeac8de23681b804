"""An SLA must be on a metric its workload's controller gets samples of: an LLM SLA on
``first_partial_ms`` passed ``check-config`` and ``set_sla``, and the LLM controller then never got a
sample and never acted. One check (``config.sla.sla_metric_problem``) refuses it in config
validation, ``set_sla``, ``desired`` and on reload."""

from __future__ import annotations

import json
import os
import subprocess
import typing
from types import SimpleNamespace

import pytest

from edge_agent.config import load_settings
from edge_agent.config.sla import sla_metric_problem
from edge_agent.daemon.app import Agent
from edge_agent.daemon.remote import RemoteTarget
from edge_agent.errors import ConfigError, EdgeAgentError
from edge_agent.metrics import LATENCY_METRICS
from edge_agent.serving.asr.service import ASR_METRICS
from edge_agent.serving.tiers.control import TierController
from edge_agent.serving.tiers.policy import policy_from_config
from edge_agent.systemd import Notifier
from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.desired import DESIRED_DOC_KEY, DESIRED_KEY
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import CommandProcessor
from edge_agent.telemetry.schema import SlaSpec
from tests.conftest import REPO
from tests.telemetry_target import TinyAgent

PREFIX = "edge/v1/dev-1"
SPEC_METRICS = typing.get_args(SlaSpec.model_fields["metric"].annotation)
# The reference: what each workload's observations carry (an LLM request's timing, an ASR utterance).
SAMPLED = {"llm": set(LATENCY_METRICS), "asr": set(ASR_METRICS)}


@pytest.mark.parametrize("workload", ["llm", "asr"])
@pytest.mark.parametrize("metric", SPEC_METRICS)
def test_a_metric_fits_a_workload_exactly_when_its_observations_carry_it(workload, metric):
    problem = sla_metric_problem(workload, metric)
    assert (problem is None) == (metric in SAMPLED[workload]), problem
    if problem is not None:
        assert repr(metric) in problem and f"{workload.upper()} SLA metric" in problem


def check_config(tmp_path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    clean.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "config"), **env)
    # random tiers: the built-in ones need the real model fetched, which is not the subject here
    clean["EDGE_AGENT_MODELS__LLM"] = '[{"name": "small", "model": "demo-phi3-small"}]'
    clean["EDGE_AGENT_MODELS__ASR"] = '[{"name": "ctc", "model": "demo-asr"}]'  # likewise Whisper base
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "edge-agent"), "check-config"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
        cwd=tmp_path,
    )


def test_check_config_refuses_an_llm_sla_on_an_asr_metric(tmp_path):
    if not (REPO / ".venv" / "bin" / "edge-agent").exists():
        pytest.skip("no .venv/bin/edge-agent in this checkout")
    out = check_config(tmp_path, EDGE_AGENT_SLA__METRIC="first_partial_ms")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.startswith("sla.metric: ") and "'first_partial_ms'" in out.stdout, out.stdout
    preset = check_config(tmp_path, EDGE_AGENT_SLA__PRESET="asr-customer-service")  # the metric from a preset
    assert preset.returncode == 2 and "first_partial_ms" in preset.stdout, preset.stdout
    assert check_config(tmp_path, EDGE_AGENT_SLA__METRIC="itl_ms").returncode == 0


def test_config_validation_names_the_field(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[sla]\nmetric = "final_ms"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert dict(err.value.problems)["sla.metric"].startswith("the LLM SLA metric must be one of")
    cfg.write_text('[sla]\nmetric = "turn_ms"\n')  # measured by `asr listen --respond`, never by the daemon
    with pytest.raises(ConfigError, match=r"sla\.metric"):
        load_settings(cfg)


@pytest.fixture
def proc(tmp_path):
    agent, sent, reported = TinyAgent(), [], []
    proc = CommandProcessor(
        agent,
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev-1",
        lambda _t, b, _c: sent.append(json.loads(b)),
        reported.append,
    )
    return proc, agent, sent, reported


def set_sla(workload: str, metric: str, cmd_id: str) -> Incoming:
    body = {"cmd_id": cmd_id, "args": {"workload": workload, "sla": {"metric": metric, "target_ms": 300}}}
    return Incoming(f"{PREFIX}/cmd/set_sla/req", json.dumps(body).encode(), None, None, None, False)


def test_set_sla_on_a_metric_the_workload_never_measures_is_rejected(proc):
    p, agent, sent, _reported = proc
    p.handle(set_sla("llm", "first_partial_ms", "s1"))
    p.handle(set_sla("asr", "ttft_ms", "s2"))
    assert [m["status"] for m in sent] == ["rejected", "rejected"]
    assert sent[0]["reason"].startswith("args.sla.metric: the LLM SLA metric must be one of")
    assert "ASR SLA metric" in sent[1]["reason"] and agent.calls == []
    p.handle(set_sla("llm", "itl_ms", "s3"))
    assert sent[-1]["status"] == "succeeded" and agent.sla["llm"].metric == "itl_ms"


def test_a_desired_with_such_an_sla_is_refused_whole(proc):
    p, agent, _sent, reported = proc
    doc = {"version": 4, "sla": {"llm": {"metric": "final_ms", "target_ms": 300}}, "pins": {"llm": "tiny"}}
    assert not p.apply_desired(json.dumps(doc).encode())
    assert agent.calls == [] and agent.pins == {}  # all or nothing: the pin did not apply either
    assert "sla.llm.metric: the LLM SLA metric" in reported[-1]["desired_error"]
    assert reported[-1]["desired_version"] is None
    assert p._desired_retry is None  # refused, not "failed": it is not retried at start


def test_the_agents_set_sla_refuses_it_before_touching_the_controller():
    calls: list = []
    controller = SimpleNamespace(set_policy=lambda *a, **k: calls.append(a))
    target = RemoteTarget(SimpleNamespace(controller=controller, asr_controller=controller))
    with pytest.raises(EdgeAgentError, match="LLM SLA metric"):
        target.set_sla("llm", SlaSpec(metric="first_partial_ms", target_ms=300))
    with pytest.raises(EdgeAgentError, match="ASR SLA metric"):
        target.set_sla("asr", SlaSpec(metric="ttft_ms", target_ms=300))
    assert calls == []


CONFIG = """
[models]
asr = []
[[models.llm]]
name = "top"
model = "demo-phi3"
[[models.llm]]
name = "light"
model = "demo-phi3"

[sla]
metric = "{metric}"
"""


def test_a_reload_refuses_such_a_file_and_such_a_stored_desired(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(CONFIG.format(metric="ttft_ms"))
    settings = load_settings(str(path))
    agent = Agent(settings, str(path), notifier=Notifier({}))
    ladder = SimpleNamespace(
        tiers=[SimpleNamespace(name="top"), SimpleNamespace(name="light")],
        active=0,
        switching=False,
        switch_to=lambda _i: True,
        relieve=lambda shedding, token_cap_ratio=None: None,
    )
    agent.controller = TierController(ladder, policy_from_config(settings.sla, 4), window_s=10, clock=lambda: 0.0)
    reported: list[dict] = []
    ledger = Ledger(tmp_path / "ledger.sqlite")
    commands = CommandProcessor(agent.remote, ledger, PREFIX, "dev-1", lambda *_: None, reported.append)
    agent.telemetry = SimpleNamespace(commands=commands)
    try:
        path.write_text(CONFIG.format(metric="first_partial_ms"))
        assert agent.reload().startswith("reload refused") and agent.controller.policy.metric == "ttft_ms"
        # A desired stored before this check existed (the ledger keeps it across upgrades).
        stale = {"version": 9, "sla": {"llm": {"metric": "first_partial_ms", "target_ms": 300}}, "pins": {}}
        ledger.put_many({DESIRED_DOC_KEY: json.dumps(stale), DESIRED_KEY: "9"})
        path.write_text(CONFIG.format(metric="ttft_ms"))
        agent.reload()
        assert agent.controller.policy.metric == "ttft_ms"
        assert "sla.llm.metric" in reported[-1]["desired_error"]
    finally:
        ledger.close()
