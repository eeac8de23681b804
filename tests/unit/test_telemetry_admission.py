"""Refusals and preemptions in the telemetry window and the fleet view (issue 42, "accounted and visible").

The counts are recorded through the hooks the daemon uses (the API's ``_count_refusal`` on an
``Overloaded``, the ladder's ``on_preempted`` incrementing ``/metrics``' preemption counter); each
window must carry what happened during it, and the sum over windows must equal ``/metrics``.
"""

from __future__ import annotations

import functools
import json

import pytest

from edge_agent.errors import Overloaded
from edge_agent.metrics.prometheus import PrometheusMetrics
from edge_agent.serving.doors.http.llm_routes import _count_refusal
from edge_agent.telemetry.admission import AdmissionDeltas, AdmissionTotals, prometheus_totals
from edge_agent.telemetry.fleet import FleetView, render_table
from edge_agent.telemetry.schema import SCHEMA_DIR, LatencyWindow
from tests.unit.test_fleet_watch_columns import window
from tests.unit.test_telemetry_publisher import rig


def refuse(metrics: PrometheusMetrics, reason: str, n: int = 1) -> None:
    for _ in range(n):
        _count_refusal(metrics, Overloaded("over budget", retry_after_s=1.0, reason=reason))


def sealed(pub, link, clock, wall) -> dict:
    clock.t += 10
    wall.t += 10
    pub.seal_window()
    pub.pump()
    return link.sent[-1][2]


def prom(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_each_window_carries_the_refusals_and_preemptions_recorded_during_it(tmp_path):
    metrics = PrometheusMetrics()
    deltas = AdmissionDeltas(functools.partial(prometheus_totals, metrics))
    pub, link, _spool, _acc, clock, wall = rig(tmp_path, admission=deltas.take)
    on_preempted = lambda: metrics.preemptions.labels("llm").inc()  # noqa: E731 - as the daemon wires it

    refuse(metrics, "over_budget", 3)
    refuse(metrics, "start_deadline")
    on_preempted()
    on_preempted()
    first = sealed(pub, link, clock, wall)
    assert first["admission"] == {
        "refused": [
            {"workload": "llm", "reason": "over_budget", "class": "chat", "count": 3},
            {"workload": "llm", "reason": "start_deadline", "class": "chat", "count": 1},
        ],
        "preempted": {"llm": 2},
    }

    refuse(metrics, "over_budget")
    second = sealed(pub, link, clock, wall)
    assert second["admission"] == {
        "refused": [{"workload": "llm", "reason": "over_budget", "class": "chat", "count": 1}],
        "preempted": {},
    }
    third = sealed(pub, link, clock, wall)  # nothing happened: counted, and zero
    assert third["admission"] == {"refused": [], "preempted": {}}

    # The windows add up to /metrics' totals.
    windows = [first, second, third]
    for reason in ("over_budget", "start_deadline"):
        in_windows = sum(r["count"] for w in windows for r in w["admission"]["refused"] if r["reason"] == reason)
        total = prom(metrics, "edge_agent:requests_refused_total", workload="llm", reason=reason, **{"class": "chat"})
        assert in_windows == total
    assert sum(w["admission"]["preempted"].get("llm", 0) for w in windows) == prom(
        metrics, "edge_agent:preemptions_total", workload="llm"
    )


def test_windows_validate_against_the_checked_in_schema_and_the_model(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((SCHEMA_DIR / "tele_latency.json").read_text())
    metrics = PrometheusMetrics()
    pub, link, _spool, _acc, clock, wall = rig(
        tmp_path, admission=AdmissionDeltas(functools.partial(prometheus_totals, metrics)).take
    )
    refuse(metrics, "over_budget", 2)
    metrics.refused.labels("llm", "queue_full", "interactive").inc()
    metrics.preemptions.labels("llm").inc()
    doc = sealed(pub, link, clock, wall)
    jsonschema.validate(doc, schema)
    LatencyWindow.model_validate(doc)
    for bad in (
        {"refused": [{"workload": "llm", "reason": "over_budget", "class": "chat", "count": 0}]},  # a count >= 1
        {"refused": [{"workload": "llm", "reason": "Over Budget!", "class": "chat", "count": 1}]},
        {"preempted": {"llm": -1}},
        {"preempted": {"LLM!": 1}},
        {"dropped": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**doc, "admission": bad}, schema)
        with pytest.raises(ValueError):
            LatencyWindow.model_validate({**doc, "admission": bad})


def test_no_source_leaves_admission_out_and_a_failing_source_never_costs_the_window(tmp_path):
    pub, link, _spool, _acc, clock, wall = rig(tmp_path)
    assert "admission" not in sealed(pub, link, clock, wall)  # an agent that does not count them

    def broken() -> AdmissionTotals:
        raise RuntimeError("counter registry gone")

    pub2, link2, _spool2, _acc2, clock2, wall2 = rig(tmp_path / "b", admission=AdmissionDeltas(broken).take)
    doc = sealed(pub2, link2, clock2, wall2)
    assert "admission" not in doc and doc["seq"] == 1


def test_the_largest_refusal_counts_are_kept_when_labels_overflow_the_bound():
    totals = AdmissionTotals(refused={("llm", f"r{k:03d}", "chat"): k + 1 for k in range(100)})
    adm = AdmissionDeltas(lambda: totals).take()
    assert len(adm.refused) == 64
    assert sorted(r.count for r in adm.refused) == list(range(37, 101))


def with_admission(device: str, seq: int, llm: list[float], admission: dict | None) -> bytes:
    body = json.loads(window(device, seq, llm))
    if admission is not None:
        body["admission"] = admission
    return json.dumps(body).encode()


def test_fleet_view_sums_refusals_by_reason_and_class_and_shows_older_agents_as_absent():
    view = FleetView(window_s=1e9, clock=lambda: 0.0)
    over = {"workload": "llm", "reason": "over_budget", "class": "chat"}
    view.ingest(
        "edge/v1/a/tele/latency",
        with_admission(
            "a",
            1,
            [10.0],
            {
                "refused": [
                    {**over, "count": 4},
                    {"workload": "llm", "reason": "start_deadline", "class": "chat", "count": 1},
                    {"workload": "asr", "reason": "over_budget", "class": "interactive", "count": 7},  # not watched
                ],
                "preempted": {"llm": 2, "asr": 5},
            },
        ),
    )
    view.ingest("edge/v1/a/tele/latency", with_admission("a", 2, [10.0], {"refused": [{**over, "count": 3}]}))
    view.ingest("edge/v1/a/tele/latency", with_admission("a", 2, [10.0], {"refused": [{**over, "count": 3}]}))  # dup
    view.ingest("edge/v1/b/tele/latency", with_admission("b", 1, [10.0], None))  # an older agent
    view.ingest("edge/v1/c/tele/latency", with_admission("c", 1, [10.0], {}))  # a newer agent, nothing refused
    view.ingest("edge/v1/d/tele/latency", with_admission("d", 1, [10.0], {"refused": "a future shape"}))
    rows = view.rows()
    a, b, c, d = rows["devices"]
    assert (a["refused"], a["preempted"]) == (8, 2)
    assert a["refused_by_reason"] == {"over_budget": 7, "start_deadline": 1}
    assert a["refused_by_class"] == {"chat": 8}
    assert (b["refused"], b["preempted"], b["refused_by_reason"]) == (None, None, None)
    assert (c["refused"], c["preempted"]) == (0, 0)
    assert (d["refused"], d["count"]) == (None, 1)  # unreadable counts: absent columns, the latency still counts
    assert view.malformed == 0
    fleet = rows["fleet"]
    assert (fleet["refused"], fleet["preempted"], fleet["refused_by_reason"]) == (
        8,
        2,
        {"over_budget": 7, "start_deadline": 1},
    )

    lines = render_table(rows).splitlines()
    header = lines[0].split()
    assert header[-2:] == ["REFUSED", "PREEMPT"]
    assert [line.split()[-2:] for line in lines[1:5]] == [["8", "2"], ["-", "-"], ["0", "0"], ["-", "-"]]
    assert "refused 8 in the last 1e+09 s: over_budget 7, start_deadline 1 (class: chat 8)" in lines


def test_fleet_view_counts_only_recent_windows():
    now = [0.0]
    view = FleetView(window_s=60.0, clock=lambda: now[0])
    refused = {"refused": [{"workload": "llm", "reason": "over_budget", "class": "chat", "count": 5}]}
    view.ingest("edge/v1/a/tele/latency", with_admission("a", 1, [10.0], refused))
    now[0] = 50.0
    view.ingest("edge/v1/a/tele/latency", with_admission("a", 2, [10.0], {**refused, "preempted": {"llm": 1}}))
    assert (view.rows()["devices"][0]["refused"], view.rows()["devices"][0]["preempted"]) == (10, 1)
    now[0] = 100.0  # the first window is older than window_s
    assert (view.rows()["devices"][0]["refused"], view.rows()["devices"][0]["preempted"]) == (5, 1)
    now[0] = 200.0  # none recent: nothing is known about the last minute
    assert view.rows()["devices"][0]["refused"] is None


def test_fleet_export_counts_every_windows_refusals_once_with_bounded_labels():
    from edge_agent.telemetry.fleet_export import MAX_REFUSAL_LABELS, FleetStore
    from tests.unit.test_fleet_export import scrape

    store = FleetStore()
    over = {"workload": "llm", "reason": "over_budget", "class": "chat"}
    first = {"refused": [{**over, "count": 4}], "preempted": {"llm": 1}}
    store.ingest("edge/v1/a/tele/latency", with_admission("a", 1, [10.0], first))
    store.ingest("edge/v1/a/tele/latency", with_admission("a", 1, [10.0], first))  # a duplicate: once
    store.ingest("edge/v1/a/tele/latency", with_admission("a", 2, [10.0], {"refused": [{**over, "count": 3}]}))
    store.ingest("edge/v1/b/tele/latency", with_admission("b", 1, [10.0], None))  # an older agent: no series
    flood = [{"workload": "llm", "reason": f"r{k}", "class": "chat", "count": 1} for k in range(MAX_REFUSAL_LABELS)]
    store.ingest("edge/v1/c/tele/latency", with_admission("c", 1, [10.0], {"refused": flood}))
    store.ingest("edge/v1/c/tele/latency", with_admission("c", 2, [10.0], {"refused": [{**over, "count": 1}]}))
    got = scrape(store)
    refused = {
        (s.labels["device"], s.labels["reason"]): s.value for s in got["edge_fleet_device_requests_refused_total"]
    }
    assert refused[("a", "over_budget")] == 7 and not any(d == "b" for d, _ in refused)
    assert sum(1 for d, _ in refused if d == "c") == MAX_REFUSAL_LABELS and ("c", "over_budget") not in refused
    assert store.counters()["refused"]["workload_limit"] == 1
    assert [(s.labels["device"], s.value) for s in got["edge_fleet_device_preemptions_total"]] == [("a", 1.0)]
