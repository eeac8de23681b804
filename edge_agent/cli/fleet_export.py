"""``edge-agent fleet export`` (the fleet to Prometheus and OTLP) and ``fleet simulate`` (simulated devices)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, EdgeAgentError

if TYPE_CHECKING:
    from ..telemetry.fleet_export import FleetStore

log = logging.getLogger(__name__)


def add_commands(fsub: Any) -> None:
    e = fsub.add_parser(
        "export",
        help="serve the fleet's merged histograms and health to Prometheus (and push OTLP)",
        description="Subscribe to the fleet's windows (MQTT 5 shared subscription: several exporters of one "
        "--share-group split the load) and retained state, and serve /metrics on --listen: classic "
        "cumulative histograms per device, workload, tier and metric, and per-device gauges.",
    )
    e.add_argument("--broker", required=True, metavar="HOST:PORT")
    e.add_argument("--listen", required=True, metavar="HOST:PORT", help="where /metrics is served")
    e.add_argument("--share-group", default="edge-fleet-export", help="shared subscription group ('' for none)")
    e.add_argument("--prefix", default="edge/v1", help="the devices' mqtt.topic_prefix, any number of levels")
    e.add_argument("--username")
    e.add_argument("--password", help="prefer EDGE_AGENT_FLEET_PASSWORD in the environment")
    e.add_argument(
        "--le-scale",
        type=int,
        default=2,
        choices=range(0, 6),
        metavar="0-5",
        help="classic bucket boundaries 2**(k/2**S) ms (default 2: 4 per doubling, <=19%% error)",
    )
    e.add_argument(
        "--max-devices",
        type=int,
        default=10_000,
        metavar="N",
        help="devices held at once; a new one beyond N is refused until an idle one expires (default 10000)",
    )
    e.add_argument(
        "--max-series-per-device",
        type=int,
        default=64,
        metavar="N",
        help="histograms (workload x tier x metric) per device; new ones beyond N are refused (default 64)",
    )
    e.add_argument(
        "--max-buckets",
        type=int,
        default=160,
        metavar="N",
        help="buckets per stored histogram: a finer one is downscaled on arrival (default 160, min 3)",
    )
    e.add_argument(
        "--stale-after-s",
        type=float,
        default=3600.0,
        metavar="S",
        help="drop a series not merged into, and a device not heard from, for S seconds (default 3600; 0: never)",
    )
    e.add_argument("--otlp", metavar="URL", help="also push OTLP/HTTP JSON metrics to URL (…/v1/metrics)")
    e.add_argument("--otlp-interval-s", type=float, default=10.0)
    e.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    e.set_defaults(func=cmd_export)
    s = fsub.add_parser(
        "simulate",
        help="publish N simulated devices' telemetry (the agent's own window and payload code)",
        description="N devices with their own device id and seq publish tele/latency every --interval-s and "
        "retained state/reported/meta, built with the agent's WindowAccumulator and payload models.",
    )
    s.add_argument("--broker", required=True, metavar="HOST:PORT")
    s.add_argument("--devices", type=int, default=10)
    s.add_argument("--interval-s", type=float, default=1.0)
    s.add_argument("--duration-s", type=float, default=None)
    s.add_argument("--prefix", default="edge/v1")
    s.add_argument("--requests-per-window", type=int, default=20)
    s.add_argument("--devices-per-connection", type=int, default=100)
    s.set_defaults(func=cmd_simulate)


def parse_hostport(value: str, flag: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError([(flag, f"expected HOST:PORT, got {value!r}")])
    return host.strip("[]"), int(port)


def _until_stopped(duration: float | None, check: Any = None) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    start = time.monotonic()
    try:
        while not stop.is_set() and (duration is None or time.monotonic() - start < duration):
            if check is not None:
                check()
            stop.wait(0.2 if duration is None else max(0.0, min(0.2, duration - (time.monotonic() - start))))
    except KeyboardInterrupt:
        pass


def store_from_args(args: argparse.Namespace) -> FleetStore:
    """The ``FleetStore`` ``fleet export`` feeds, configured from the flags: the topic prefix and the bounds
    one device (or a flood of device ids) can take (``ExportLimits``); a bound out of range is a ConfigError."""
    from ..telemetry.fleet_export import ExportLimits, FleetStore

    try:
        limits = ExportLimits(
            max_devices=args.max_devices,
            max_series_per_device=args.max_series_per_device,
            max_buckets=args.max_buckets,
            stale_after_s=args.stale_after_s,
        )
    except ValueError as exc:
        raise ConfigError([("fleet export", str(exc))]) from None
    return FleetStore(prefix=args.prefix, limits=limits)


def cmd_export(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.process_collector import ProcessCollector

    from ..telemetry.fleet_export import FleetCollector, MqttFeed, subscriptions

    host, port = parse_hostport(args.broker, "--broker")
    lhost, lport = parse_hostport(args.listen, "--listen")
    store = store_from_args(args)
    pusher = None
    if args.otlp:
        from ..telemetry.fleet_otlp import OtlpPusher

        try:
            pusher = OtlpPusher(store, args.otlp, interval_s=args.otlp_interval_s)
        except ValueError as exc:
            raise ConfigError([("--otlp", str(exc))]) from None
    registry = CollectorRegistry()
    registry.register(FleetCollector(store, le_scale=args.le_scale))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total: what the exporter itself costs
    try:
        server, _thread = start_http_server(lport, addr=lhost, registry=registry)
    except OSError as exc:
        raise EdgeAgentError(f"cannot listen on {lhost}:{lport}: {exc}") from exc
    password = args.password or os.environ.get("EDGE_AGENT_FLEET_PASSWORD")
    feed = MqttFeed(
        store,
        host,
        port,
        subscriptions(args.prefix, args.share_group or None),
        username=args.username,
        password=password,
    )
    try:
        feed.start()
    except OSError as exc:
        server.shutdown()
        raise EdgeAgentError(f"cannot connect to broker {host}:{port}: {exc}") from exc
    if pusher is not None:
        pusher.start()
    print(f"serving http://{lhost}:{server.server_port}/metrics from {host}:{port}", flush=True)

    def check() -> None:
        if feed.errors:
            raise EdgeAgentError(feed.errors[0])

    try:
        _until_stopped(args.duration, check)
    finally:
        if pusher is not None:
            pusher.stop()
        feed.stop()
        server.shutdown()
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..telemetry.simulate import Simulator

    host, port = parse_hostport(args.broker, "--broker")
    if args.devices < 1 or args.interval_s <= 0:
        raise ConfigError([("--devices", "needs --devices >= 1 and --interval-s > 0")])
    sim = Simulator(
        host,
        port,
        args.devices,
        args.interval_s,
        prefix=args.prefix,
        devices_per_connection=args.devices_per_connection,
        requests_per_window=args.requests_per_window,
    )
    try:
        sim.start()
    except OSError as exc:
        raise EdgeAgentError(f"cannot connect to broker {host}:{port}: {exc}") from exc
    signal.signal(signal.SIGTERM, lambda *_: sim.stop())
    start = time.monotonic()
    try:
        sim.run(args.duration_s)
    except KeyboardInterrupt:
        pass
    finally:
        sim.close()
    elapsed = time.monotonic() - start
    print(
        f"{sim.published} messages from {args.devices} devices in {elapsed:.1f} s "
        f"({sim.published / max(elapsed, 1e-9):.0f}/s), {sim.late_rounds} late rounds",
        flush=True,
    )
    return 0
