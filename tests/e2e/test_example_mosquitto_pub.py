"""Each command's ``mosquitto_pub`` line from docs/telemetry.md, run as printed against a real
mosquitto: the payload arrives as a valid request, with the MQTT 5 response topic and correlation data."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import threading

import paho.mqtt.client as mqtt
import pytest

from edge_agent.telemetry import examples
from edge_agent.telemetry.command_args import ALLOWED
from edge_agent.telemetry.schema import CommandRequest
from tests.mqtt_broker import Broker, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("mosquitto_pub") is None, reason="mosquitto_pub missing (apt package mosquitto-clients)"
)


def test_each_documented_mosquitto_pub_line_delivers_a_valid_mqtt5_request(tmp_path):
    got: list[mqtt.MQTTMessage] = []
    lock = threading.Lock()
    with Broker(tmp_path / "broker").start() as broker:
        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        ready = threading.Event()
        sub.on_connect = lambda c, *_a: (c.subscribe("edge/v1/dev-17/cmd/+/req", qos=1), ready.set())

        def on_message(_c, _u, m):
            with lock:
                got.append(m)

        sub.on_message = on_message
        sub.connect("127.0.0.1", broker.port)
        sub.loop_start()
        try:
            assert ready.wait(10)
            wait_for(lambda: sub.is_connected(), 10, what="subscriber")
            for name in sorted(ALLOWED):
                argv = shlex.split(examples.mosquitto_pub(name, host="127.0.0.1"))
                argv[1:1] = ["-p", str(broker.port)]
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
                assert proc.returncode == 0, proc.stderr
            wait_for(lambda: len(got) >= len(ALLOWED), 10, what="every request")
        finally:
            sub.disconnect()
            sub.loop_stop()
    for m in got:
        name = m.topic.split("/")[-2]
        req = CommandRequest.model_validate_json(m.payload)
        ALLOWED[name].model_validate(req.args)
        assert m.properties.ResponseTopic == examples.REPLY_TOPIC
        assert m.properties.CorrelationData == req.cmd_id.encode()
    assert sorted(m.topic.split("/")[-2] for m in got) == sorted(ALLOWED)
