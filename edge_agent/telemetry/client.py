"""The MQTT link: paho-mqtt 2.x, MQTT v5, ``connect_async`` + ``loop_start``, TLS, Last Will, birth.

What the wrapper guarantees (each point is a paho pitfall it exists for):
- a broker that is missing at boot, or goes away, never stops the agent: paho's thread keeps
  retrying, with an exponential delay (1 s doubling to ``max_delay_s``) scaled by a random factor
  in [0.5, 1] so that a fleet does not reconnect in lock-step after a broker restart;
- subscriptions are made in ``on_connect``, so they survive every reconnect;
- no exception ever escapes a callback (one would kill paho's network thread while
  ``is_connected()`` still said True): each is caught, logged and counted in ``callback_errors``;
- ``state`` is the Last Will (``offline``, retained) and is republished ``online`` on every connect,
  followed by the other birth messages (``meta``, ``reported``);
- callbacks only enqueue: PUBACKs go to ``acks`` (drained by the telemetry thread, which owns the
  spool), messages go to ``on_message`` which must itself only enqueue.

A PUBACK is not delivery (MQTT 5 acks with 0x10 "no matching subscribers"): anything below 0x80
means the broker took responsibility, and that is all store-and-forward can know.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..config import MqttConfig

log = logging.getLogger(__name__)

MAX_ACK_BACKLOG = 100_000


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message to publish: topic, payload, QoS and the retain flag."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


@dataclass(frozen=True, slots=True)
class Incoming:
    """A message the broker delivered, with the MQTT 5 properties a command's reply needs."""

    topic: str
    payload: bytes
    response_topic: str | None
    correlation_data: bytes | None
    expiry_s: int | None  # the remaining message expiry interval the broker forwarded
    retain: bool


def _reason_value(rc: object) -> int:
    value = getattr(rc, "value", rc)
    return int(value) if isinstance(value, int) else 0x80


class MqttLink:
    """One connection to the broker for one device. Thread-safe ``publish``."""

    def __init__(
        self,
        cfg: MqttConfig,
        *,
        will: bytes,
        birth: Callable[[], Iterable[Outgoing]] = tuple,
        on_message: Callable[[Incoming], None] | None = None,
        subscriptions: Iterable[str] = (),
        max_inflight: int = 20,
        max_delay_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.prefix = f"{cfg.topic_prefix}/{cfg.device_id}"
        self._birth = birth
        self._on_message = on_message
        self._subscriptions = [self.topic(s) for s in subscriptions]
        self._max_delay_s = max_delay_s
        self._rng = rng or random.Random()
        self._failures = 0
        self._lock = threading.Lock()
        self.acks: deque[tuple[int, int]] = deque(maxlen=MAX_ACK_BACKLOG)  # (mid, reason code)
        self.connected = threading.Event()
        self.generation = 0  # +1 per successful connect
        self.callback_errors = 0
        self.connects = 0
        self.disconnects = 0
        self.last_error: str | None = None
        self._started = False
        self.on_ack: Callable[[], None] | None = None  # wakes the thread that drains ``acks``

        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=cfg.device_id, protocol=mqtt.MQTTv5, reconnect_on_failure=True
        )
        client.suppress_exceptions = True  # second line of defence; ours are caught below
        # paho reports routine states ("not connected") at ERROR; our own logs carry what matters.
        paho_log = logging.getLogger("edge_agent.telemetry.paho")
        client.on_log = lambda _c, _u, _level, buf: paho_log.debug("%s", buf)
        client.max_inflight_messages_set(max_inflight)
        client.max_queued_messages_set(max(100, max_inflight * 4))
        client.reconnect_delay_set(1, max(1, int(max_delay_s)))
        if cfg.username:
            client.username_pw_set(cfg.username, cfg.password.get_secret_value() if cfg.password else None)
        if cfg.tls is not None:
            client.tls_set(
                ca_certs=str(cfg.tls.ca_file) if cfg.tls.ca_file else None,
                certfile=str(cfg.tls.cert_file) if cfg.tls.cert_file else None,
                keyfile=str(cfg.tls.key_file) if cfg.tls.key_file else None,
                cert_reqs=ssl.CERT_REQUIRED,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        client.will_set(self.topic("state"), will, qos=1, retain=True)
        client.on_connect = self._guard(self._handle_connect)
        client.on_connect_fail = self._guard(self._handle_connect_fail)
        client.on_disconnect = self._guard(self._handle_disconnect)
        client.on_publish = self._guard(self._handle_publish)
        client.on_message = self._guard(self._handle_message)
        self._client = client

    def topic(self, suffix: str) -> str:
        return f"{self.prefix}/{suffix}"

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> MqttLink:
        """Begin connecting in the background; returns at once even when no broker is there."""
        self._client.connect_async(self.cfg.host, self.cfg.port, keepalive=self.cfg.keepalive_s)
        self._client.loop_start()
        self._started = True
        return self

    def stop(self, final_state: bytes | None = None, timeout_s: float = 5.0) -> None:
        """Publish ``final_state`` (retained, e.g. a clean "offline"), disconnect, stop the thread.
        A clean MQTT 5 disconnect tells the broker not to send the Will."""
        if not self._started:
            return
        self._started = False
        if final_state is not None and self.connected.is_set():
            info = self._client.publish(self.topic("state"), final_state, qos=1, retain=True)
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError):  # not queued (disconnected meanwhile)
                pass
        if self._client.is_connected():
            self._client.disconnect()
        self._client.loop_stop()
        self.connected.clear()

    def wait_connected(self, timeout_s: float) -> bool:
        return self.connected.wait(timeout_s)

    # -- publishing -----------------------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Properties | None = None
    ) -> int | None:
        """Hand one message to paho; the mid to match a PUBACK, or None when paho refused it."""
        try:
            info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        except (ValueError, OSError) as exc:
            self.last_error = f"publish {topic}: {exc}"
            log.warning("%s", self.last_error)
            return None
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            # NO_CONN still queues a QoS 1 message (paho sends it on reconnect); anything else (queue full) did not.
            return None
        return info.mid

    def drain_acks(self) -> list[tuple[int, int]]:
        out = []
        while self.acks:
            out.append(self.acks.popleft())
        return out

    # -- callbacks (paho's network thread; every one guarded) ---------------------------------------

    def _guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        def guarded(*args: object) -> None:
            try:
                fn(*args)
            except Exception:  # never let it reach paho's thread
                self.callback_errors += 1
                log.exception("MQTT callback %s failed", fn.__name__)

        guarded.__name__ = fn.__name__
        return guarded

    def _handle_connect(self, client: mqtt.Client, _ud: object, _flags: object, rc: object, _props: object) -> None:
        code = _reason_value(rc)
        if code >= 0x80:
            self.last_error = f"broker {self.cfg.host}:{self.cfg.port} refused the connection: {rc}"
            log.error("%s", self.last_error)
            self._schedule_retry()
            return
        self._failures = 0
        client.reconnect_delay_set(1, max(1, int(self._max_delay_s)))
        self.connects += 1
        self.generation += 1
        for topic in self._subscriptions:
            client.subscribe(topic, qos=1)
        self.connected.set()
        log.info("connected to %s:%s as %s", self.cfg.host, self.cfg.port, self.cfg.device_id)
        try:  # a failing birth builder must not keep telemetry from flowing
            births = list(self._birth())
        except Exception:
            self.callback_errors += 1
            log.exception("building the birth messages failed; publishing state only")
            births = []
        for msg in births:
            client.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain)

    def _handle_connect_fail(self, _client: mqtt.Client, _ud: object) -> None:
        self.last_error = f"cannot reach broker {self.cfg.host}:{self.cfg.port}"
        log.debug("%s", self.last_error)
        self._schedule_retry()

    def _handle_disconnect(self, _client: mqtt.Client, _ud: object, _flags: object, rc: object, _props: object) -> None:
        was = self.connected.is_set()
        self.connected.clear()
        if was:
            self.disconnects += 1
            # Our own stop() clears _started first: a normal goodbye, not a problem.
            (log.warning if self._started else log.info)(
                "disconnected from %s:%s: %s", self.cfg.host, self.cfg.port, rc
            )
        if self._started:
            self._schedule_retry()

    def _schedule_retry(self) -> None:
        self._failures = min(self._failures + 1, 16)
        delay = min(self._max_delay_s, 2.0 ** (self._failures - 1)) * self._rng.uniform(0.5, 1.0)
        # reconnect_delay_set resets paho's own backoff: its next wait is exactly our jittered delay.
        # paho annotates the delays as int, but uses them as seconds in float arithmetic: sub-second is fine
        self._client.reconnect_delay_set(max(0.2, delay), max(1, int(self._max_delay_s)))  # type: ignore[arg-type]

    def _handle_publish(self, _client: mqtt.Client, _ud: object, mid: int, rc: object, _props: object) -> None:
        self.acks.append((mid, _reason_value(rc)))
        if self.on_ack is not None:
            self.on_ack()

    def _handle_message(self, _client: mqtt.Client, _ud: object, msg: mqtt.MQTTMessage) -> None:
        if self._on_message is None:
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        expiry = getattr(props, "MessageExpiryInterval", None) if props else None
        self._on_message(
            Incoming(
                msg.topic,
                bytes(msg.payload),
                response_topic,
                bytes(correlation) if correlation is not None else None,
                int(expiry) if expiry is not None else None,
                bool(msg.retain),
            )
        )


def response_properties(correlation_data: bytes | None, expiry_s: int | None = None) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    if correlation_data is not None:
        props.CorrelationData = correlation_data
    if expiry_s is not None:
        props.MessageExpiryInterval = expiry_s
    return props
