"""The fleet's pins and ``desired`` state stay in force, and ``reported`` tells the truth about them
(issue 15, items 4 and 5), against a real ``edge-agent run`` and a real mosquitto:

- pin a light tier, then unpin on an idle device: it used to stay on the light tier for ever
  ("insufficient: fewer than min_samples"); now it goes back to the top tier;
- a fleet ``desired`` SLA, then SIGHUP: the file's SLA used to replace it silently while ``reported``
  kept showing the desired one; now the desired stays on top of the file and ``reported`` is
  republished with each value's source;
- a restart: the retained desired (same version, already in the ledger) used to be skipped, so the
  device ran the file's SLA while ``reported`` said ``desired_version: 7``; now the stored desired is
  re-applied before READY=1.
What is in force is read with ``get_status`` (the controller's own policy), not from ``reported``.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.daemon_proc import Daemon, config_text, free_port, wait_for
from tests.mqtt_broker import Broker

pytest.importorskip("paho.mqtt.client")

ONE_TIER = 'name = "small"\nmodel = "demo-phi3"\nmax_new_tokens = 48\nmax_batch = 2\n'
TWO_TIERS = (
    'name = "top"\nmodel = "demo-phi3"\nmax_new_tokens = 48\nmax_batch = 2\n\n'
    '[[models.llm]]\nname = "light"\nmodel = "demo-phi3"\nmax_new_tokens = 48\nmax_batch = 2\n'
)


def publish(broker: Broker, topic: str, payload: bytes, retain: bool = False) -> None:
    import paho.mqtt.publish as mqtt_publish

    mqtt_publish.single(
        topic,
        payload,
        qos=1,
        retain=retain,
        hostname="127.0.0.1",
        port=broker.port,
        client_id=f"fleet-{time.monotonic_ns()}",
    )


def command(broker: Broker, daemon: Daemon, name: str, cmd_id: str, args: dict | None = None) -> dict:
    """``cmd/<name>/req``, then its final response on the daemon's own ``res`` topic."""
    prefix = f"edge/v1/{daemon.device}"
    publish(broker, f"{prefix}/cmd/{name}/req", json.dumps({"cmd_id": cmd_id, "args": args or {}}).encode())
    final = ("succeeded", "failed", "rejected", "expired")
    msg = wait_for(
        lambda: next(
            (
                m
                for m in daemon.listener.of(f"cmd/{name}/res")
                if m.get("cmd_id") == cmd_id and m.get("status") in final
            ),
            None,
        ),
        20,
        what=f"the final response to {name} {cmd_id}",
    )
    assert msg["status"] == "succeeded", msg
    return msg.get("result") or {}


def live_reported(daemon: Daemon, since: int = 0) -> list[dict]:
    """``reported`` documents this daemon published while the listener watched (not the retained copy)."""
    topic = f"edge/v1/{daemon.device}/reported"
    return [p for t, p, retained in daemon.listener.messages[since:] if t == topic and not retained]


@pytest.fixture
def broker(tmp_path):
    b = Broker(tmp_path / "broker").start()
    yield b
    b.kill()


def test_unpin_on_an_idle_device_goes_back_to_the_top_tier(tmp_path, broker):
    api = free_port()
    cfg = config_text(tmp_path / "agent", broker.port, api).replace(ONE_TIER, TWO_TIERS)
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port, config=cfg, api_port=api)
    try:
        daemon.start()
        wait_for(
            lambda: any(r["active_tiers"].get("llm") == "top" for r in live_reported(daemon)),
            30,
            what="reported on the top tier",
        )
        command(broker, daemon, "pin_tier", "pin-1", {"workload": "llm", "tier": "light"})
        wait_for(
            lambda: any(
                r["active_tiers"].get("llm") == "light" and r["pins"].get("llm") == "light"
                for r in live_reported(daemon)
            ),
            60,
            what="reported on the pinned light tier",
        )
        mark = len(daemon.listener.messages)
        t0 = time.monotonic()
        command(broker, daemon, "unpin_tier", "unpin-1", {"workload": "llm"})
        try:
            back = wait_for(
                lambda: next(
                    (r for r in live_reported(daemon, mark) if r["active_tiers"].get("llm") == "top" and not r["pins"]),
                    None,
                ),
                20,
                what="reported back on the top tier after the unpin",
            )
        except AssertionError:
            last = live_reported(daemon, mark)
            raise AssertionError(
                f"still on {last[-1]['active_tiers'] if last else '?'} 20 s after the unpin of an idle device"
            ) from None
        print(f"back on the top tier {time.monotonic() - t0:.1f} s after the unpin")
        assert back["sources"]["pins.llm"] == "command"
    finally:
        print(daemon.close()[-3000:])


def test_desired_sla_survives_sighup_and_restart_and_reported_says_so(tmp_path, broker):
    daemon = Daemon(tmp_path / "agent", broker_port=broker.port)  # the file says target_ms = 387
    second = None
    try:
        daemon.start()
        desired = {"version": 7, "sla": {"llm": {"target_ms": 222, "window_s": 5, "min_samples": 3}}}
        publish(broker, f"edge/v1/{daemon.device}/desired", json.dumps(desired).encode(), retain=True)
        wait_for(
            lambda: any(
                r.get("desired_version") == 7 and r["sla"]["llm"]["target_ms"] == 222 for r in live_reported(daemon)
            ),
            30,
            what="desired version 7 reported",
        )
        assert command(broker, daemon, "get_status", "st-1")["sla"]["llm"]["target_ms"] == 222

        # SIGHUP: the file is read again; the desired stays on top, and reported is published again.
        mark = len(daemon.listener.messages)
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: daemon.notify.seen("STATUS", contains="reloaded"), 20, what="the reload")
        in_force = command(broker, daemon, "get_status", "st-2")["sla"]["llm"]["target_ms"]
        assert in_force == 222, f"after SIGHUP the device runs target {in_force} ms; reported says 222 (desired 7)"
        rep = wait_for(
            lambda: next((r for r in live_reported(daemon, mark)), None), 10, what="reported republished after SIGHUP"
        )
        assert rep["sla"]["llm"]["target_ms"] == 222 and rep["desired_version"] == 7, rep
        assert rep["sources"]["sla.llm"] == "desired@7", rep

        # Restart on the same ledger: the broker re-delivers the retained desired version 7.
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
        second = Daemon(
            tmp_path / "agent",
            broker_port=broker.port,
            config=daemon.cfg.read_text(),
            api_port=daemon.api_port,
            name="agent2",
        )
        second.start()
        rep = wait_for(
            lambda: next((r for r in reversed(live_reported(second)) if r.get("desired_version") == 7), None),
            20,
            what="reported desired version 7 after the restart",
        )
        in_force = command(broker, second, "get_status", "st-3")["sla"]["llm"]["target_ms"]
        assert in_force == 222, f"after a restart the device runs target {in_force} ms while reporting desired 7"
        assert rep["sla"]["llm"]["target_ms"] == 222 and rep["sources"]["sla.llm"] == "desired@7", rep
        assert not rep.get("desired_error"), rep
        assert "desired version 7 in force" in second.output()
    finally:
        print(daemon.close()[-3000:])
        if second is not None:
            print(second.close()[-3000:])
