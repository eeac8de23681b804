"""The example payloads of docs/telemetry.md: every topic and command covered, each valid against the
checked-in JSON Schemas, the minimal command payloads accepted by the real command processor, and the
docs section the same as the generator's output."""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import Draft202012Validator

from edge_agent.telemetry import examples
from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.command_args import ALLOWED
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import CommandProcessor
from edge_agent.telemetry.schema import SCHEMA_DIR
from tests.telemetry_target import TinyAgent

DOC = examples.DOCS.read_text()


def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads((SCHEMA_DIR / f"{name}.json").read_text()))


def documented_event_types() -> set[str]:
    """The event types the topics table of docs/telemetry.md lists (the reference, not the generator)."""
    row = next(line for line in DOC.splitlines() if line.startswith("| `evt/<type>`"))
    return set(re.findall(r"`([a-z_]+)`", row.split("|")[3])) - {"workload"}


def test_every_topic_and_event_type_has_an_example():
    topics = [ex.topic for ex in examples.topic_examples()]
    assert {"state", "meta", "reported", "tele/latency", "desired"} <= set(topics)
    events = {t.removeprefix("evt/") for t in topics if t.startswith("evt/")}
    assert documented_event_types() <= events and len(documented_event_types()) >= 9
    assert set(examples.COMMANDS) == set(ALLOWED)


@pytest.mark.parametrize("ex", examples.topic_examples(), ids=lambda ex: ex.topic)
def test_topic_example_is_valid_against_its_json_schema(ex):
    errors = list(validator(ex.schema_name).iter_errors(ex.json()))
    assert not errors, [e.message for e in errors]


def test_the_window_example_carries_every_series_the_docs_describe():
    (win,) = [ex.json() for ex in examples.topic_examples() if ex.topic == "tele/latency"]
    series = {s["workload"]: s for s in win["series"]}
    assert set(series) == {"llm", "asr"}
    assert {"ttft_ms", "itl_ms"} <= set(series["llm"]["histograms"])
    assert {"first_partial_ms", "final_ms"} <= set(series["asr"]["histograms"])


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_command_examples_are_valid_and_the_minimal_payload_runs(tmp_path, name):
    req, responses = examples.command_examples(name)
    assert not list(validator("cmd_request").iter_errors(json.loads(req.to_json())))
    for res in responses:
        assert not list(validator("cmd_response").iter_errors(json.loads(res.to_json())))
    minimal = json.loads(examples.minimal_request(name))
    assert not list(validator("cmd_request").iter_errors(minimal))
    # The exact payload the docs' mosquitto_pub line sends, through the device's real command processor.
    sent: list[dict] = []
    proc = CommandProcessor(
        TinyAgent(tiers={"llm": ["large", "small"], "asr": ["base"]}),
        Ledger(tmp_path / "ledger.sqlite"),
        "edge/v1/dev-17",
        "dev-17",
        lambda _t, body, _c: sent.append(json.loads(body)),
        reply_prefixes=("fleet/replies/",),
    )
    line = examples.mosquitto_pub(name)
    assert f"-t edge/v1/dev-17/cmd/{name}/req" in line and "-V mqttv5" in line
    proc.handle(
        Incoming(
            f"edge/v1/dev-17/cmd/{name}/req",
            examples.minimal_request(name).encode(),
            examples.REPLY_TOPIC,
            req.cmd_id.encode(),
            None,
            False,
        )
    )
    assert [m["status"] for m in sent] == ["accepted", "executing", "succeeded"], sent
    assert [m.status for m in responses] == ["accepted", "executing", "succeeded"]


def test_an_empty_get_status_is_rejected_as_the_docs_say(tmp_path):
    assert list(validator("cmd_request").iter_errors({}))  # the schema requires cmd_id
    sent: list[dict] = []
    proc = CommandProcessor(
        TinyAgent(),
        Ledger(tmp_path / "ledger.sqlite"),
        "edge/v1/dev-17",
        "dev-17",
        lambda _t, body, _c: sent.append(json.loads(body)),
    )
    proc.handle(Incoming("edge/v1/dev-17/cmd/get_status/req", b"{}", None, None, None, False))
    (got,) = sent
    documented = json.loads(examples.rejected_example().to_json())
    assert (
        (got["status"], got["reason"])
        == (documented["status"], documented["reason"])
        == ("rejected", documented["reason"])
    )
    assert "cmd_id" in got["reason"]


def test_docs_section_is_what_the_generator_writes():
    start, end = DOC.index(examples.BEGIN), DOC.index(examples.END) + len(examples.END)
    assert DOC[start:end] == examples.markdown(), "run: python -m edge_agent.telemetry.examples --write"
    assert examples.main(["--check"]) == 0
    # Every command's mosquitto_pub line is in the docs.
    for name in ALLOWED:
        assert examples.mosquitto_pub(name) in DOC
