from __future__ import annotations

import random

from edge_agent.config import MqttConfig
from edge_agent.telemetry.client import Incoming, MqttLink


def test_reconnect_delay_doubles_with_jitter_and_is_capped():
    link = MqttLink(MqttConfig(device_id="dev-1"), will=b"offline", max_delay_s=30, rng=random.Random(1))
    delays = []
    for _ in range(10):
        link._schedule_retry()
        delays.append(link._client._reconnect_min_delay)
    for k, d in enumerate(delays):
        nominal = min(30.0, 2.0**k)
        assert max(0.2, 0.5 * nominal) <= d <= nominal
    assert len({round(d, 6) for d in delays[5:]}) > 1  # jittered, not lock-step


def test_callbacks_never_raise_and_count_errors():
    def broken(_msg: Incoming) -> None:
        raise RuntimeError("handler bug")

    link = MqttLink(MqttConfig(device_id="dev-1"), will=b"offline", on_message=broken)

    class Msg:
        topic, payload, retain, properties = "edge/v1/dev-1/cmd/x/req", b"{}", False, None

    link._client.on_message(link._client, None, Msg())  # what paho's thread would call
    link._client.on_publish(link._client, None, 7, "not a reason code", None)
    assert link.callback_errors == 1
    assert link.drain_acks() == [(7, 0x80)]  # an unreadable reason code counts as a failure


def test_topics_live_under_prefix_and_device_id():
    link = MqttLink(MqttConfig(device_id="dev-9", topic_prefix="edge/v1"), will=b"x", subscriptions=("desired",))
    assert link.topic("tele/latency") == "edge/v1/dev-9/tele/latency"
    assert link._subscriptions == ["edge/v1/dev-9/desired"]
