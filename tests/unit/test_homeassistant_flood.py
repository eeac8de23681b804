"""A flood on the Home Assistant select's command topic, in process and on fake clocks: its log lines
are bounded by the command path's per-reason limit, and every choice is either answered or counted
as dropped in ``commands_dropped`` (was: one INFO line per message, drops unaccounted for here)."""

from __future__ import annotations

import json
import logging

from edge_agent.telemetry.client import Incoming
from edge_agent.telemetry.homeassistant import Discovery
from edge_agent.telemetry.ledger import Ledger
from edge_agent.telemetry.remote_commands import LOG_EVERY_S, MAX_QUEUE, CommandProcessor
from tests.telemetry_target import TinyAgent

PREFIX = "edge/v1/dev.17"
FLOOD = 2000


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_select_flood_logs_a_bounded_number_of_lines_and_counts_every_drop(tmp_path, caplog):
    clock, wall = Clock(100.0), Clock(1.7e9)
    sent: list[dict] = []
    events: list[dict] = []
    proc = CommandProcessor(
        TinyAgent(tiers={"llm": ["large", "small"]}),
        Ledger(tmp_path / "l.sqlite"),
        PREFIX,
        "dev.17",
        lambda _t, body, _c: sent.append(json.loads(body)),
        clock=clock,
        wall=wall,
        on_drops=events.append,
    )
    d = Discovery(
        enabled=True,
        ha_prefix="homeassistant",
        topic=lambda s: f"{PREFIX}/{s}",
        device_id="dev.17",
        version="1.2.3",
        marker=tmp_path / "ha.json",
        select_allowed=True,
        submit=proc.submit,  # as the service wires it: the select's choices join the command queue
        wall=wall,
        clock=clock,
    )
    set_topic = f"{PREFIX}/ha/tier/llm/set"
    with caplog.at_level(logging.INFO, logger="edge_agent.telemetry"):
        # paho's thread delivers the flood faster than the worker runs: the worker is not running yet.
        for k in range(FLOOD):
            d.on_select(Incoming(set_topic, b"small" if k % 2 else b"auto", None, None, None, False))
        while not proc._queue.empty():  # then the worker takes what the queue held
            proc.handle(*proc._queue.get_nowait())
        proc.report_drops(force=True)
        flood_lines = [r.getMessage() for r in caplog.records]
        clock.t += LOG_EVERY_S + 0.5
        d.on_select(Incoming(set_topic, b"small", None, None, None, False))
    answered = {m["cmd_id"] for m in sent if m["status"] in ("succeeded", "rejected", "failed", "expired")}
    dropped = sum(e["counts"].get("queue_full", 0) for e in events)
    assert len(answered) == MAX_QUEUE and dropped == FLOOD - MAX_QUEUE  # every choice accounted for
    assert proc.stats["dropped"] == FLOOD - MAX_QUEUE
    # One line per reason per period: the pin, the unpin, the full queue (was: one per message).
    assert len(flood_lines) <= 3, flood_lines
    later = [r.getMessage() for r in caplog.records][len(flood_lines) :]
    assert len(later) == 1 and "more like it" in later[0], later


def test_a_flood_of_retained_choices_is_logged_once_per_period(tmp_path, caplog):
    clock = Clock(100.0)
    submitted: list[Incoming] = []
    d = Discovery(
        enabled=True,
        ha_prefix="homeassistant",
        topic=lambda s: f"{PREFIX}/{s}",
        device_id="dev.17",
        version="1.2.3",
        marker=tmp_path / "ha.json",
        select_allowed=True,
        submit=submitted.append,
        clock=clock,
    )
    with caplog.at_level(logging.INFO, logger="edge_agent.telemetry"):
        for _ in range(500):
            d.on_select(Incoming(f"{PREFIX}/ha/tier/llm/set", b"small", None, None, None, True))
    assert submitted == [] and len(caplog.records) == 1
