from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from edge_agent.metrics.histogram import ExponentialHistogram
from edge_agent.telemetry import schema as s


def test_checked_in_json_schemas_are_current():
    assert s.stale_files() == [], "run: python -m edge_agent.telemetry.schema --write"


def test_check_cli_reports_stale_files(tmp_path, capsys):
    s.write_files(tmp_path)
    assert s.stale_files(tmp_path) == []
    (tmp_path / "state.json").write_text("{}")
    assert s.stale_files(tmp_path) == ["state.json"]


def test_every_payload_carries_its_schema_version():
    for name in s.PAYLOADS:
        schema = s.json_schemas()[name]
        assert "schema" in schema["properties"], name
        assert schema["additionalProperties"] is False, name
    assert s.SCHEMA_VERSIONS["tele_latency"] == "edge-agent.tele.latency/1"


def _window(**over):
    h = ExponentialHistogram()
    h.record_many([12.0, 15.0, 40.0])
    doc = dict(
        device_id="dev-1",
        session=3,
        boot_id="b",
        seq=2**64 - 1,
        clock_synced=True,
        version="0.1.0",
        window={"start_wall": 1.0, "end_wall": 11.0, "start_mono": 5.0, "end_mono": 15.0, "duration_s": 10.0},
        series=[
            {
                "workload": "llm",
                "tier": "small",
                "model": "demo-phi3",
                "requests": 3,
                "throughput": {"requests_per_s": 0.3},
                "histograms": {"ttft_ms": h.to_dict()},
                "local": {"ttft_ms": {"count": 3, "p50": 15.0, "p95": 40.0, "p99": 40.0}},
            }
        ],
    )
    doc.update(over)
    return doc


def test_latency_window_round_trips_with_64_bit_seq_and_histogram():
    win = s.LatencyWindow.model_validate(_window())
    wire = json.loads(win.to_json())
    assert wire["schema"] == "edge-agent.tele.latency/1" and wire["seq"] == 2**64 - 1
    assert wire["series"][0]["local"]["ttft_ms"]["aggregatable"] is False
    back = s.LatencyWindow.model_validate_json(win.to_json())
    assert back.series[0].histograms["ttft_ms"].to_histogram().count == 3


@pytest.mark.parametrize(
    "change, where",
    [
        ({"seq": 2**64}, "seq"),
        ({"seq": -1}, "seq"),
        ({"schema": "edge-agent.tele.latency/2"}, "schema"),
        ({"device_id": "a/b"}, "device_id"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_windows_are_refused_naming_the_field(change, where):
    with pytest.raises(ValidationError) as info:
        s.LatencyWindow.model_validate(_window(**change))
    assert where in str(info.value)


def test_inconsistent_histogram_is_refused():
    doc = _window()
    doc["series"][0]["histograms"]["ttft_ms"]["count"] = 99
    with pytest.raises(ValidationError, match="count"):
        s.LatencyWindow.model_validate(doc)


def test_desired_refuses_unknown_workload_names():
    with pytest.raises(ValidationError):
        s.Desired.model_validate({"version": 1, "pins": {"LLM!": "small"}})
    assert s.Desired.model_validate({"version": 1, "pins": {"llm": None}}).pins == {"llm": None}


def test_command_request_cmd_id_is_restricted():
    with pytest.raises(ValidationError):
        s.CommandRequest.model_validate({"cmd_id": "../../etc"})
    assert s.CommandRequest.model_validate({"cmd_id": "c-1", "args": {}}).cmd_id == "c-1"


def test_real_payloads_validate_against_the_checked_in_files():
    jsonschema = pytest.importorskip("jsonschema")
    files = {name: json.loads((s.SCHEMA_DIR / f"{name}.json").read_text()) for name in s.PAYLOADS}
    samples = {
        "tele_latency": s.LatencyWindow.model_validate(_window()),
        "state": s.State(device_id="d", state="offline", session=1, boot_id="b", version="v", reason="last will"),
        "event": s.Event(
            device_id="d",
            type="spool_drop",
            session=1,
            seq=3,
            at_wall=1.0,
            at_mono=2.0,
            data=s.SpoolDrop(reason="full", windows=2, seq_ranges=[(1, 2)]).model_dump(),
        ),
        "cmd_response": s.CommandResponse(
            device_id="d", cmd_id=None, command="x", status="rejected", reason="malformed", at_wall=1.0
        ),
        "desired": s.Desired(version=2, pins={"llm": None}),
    }
    for name, model in samples.items():
        jsonschema.validate(json.loads(model.to_json()), files[name])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**json.loads(samples["state"].to_json()), "state": "asleep"}, files["state"])
