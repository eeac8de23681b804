"""``edge-agent fleet``: watch devices' telemetry over MQTT (``watch``), sign commands (``keygen``, ``sign``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import ConfigError, EdgeAgentError
from ..telemetry.fleet import FleetView, render_table
from ..telemetry.signing import add_cli as add_signing_commands
from .fleet_export import add_commands as add_export_commands


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("fleet", help="fleet tools: watch devices' telemetry over MQTT, sign commands")
    fsub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    w = fsub.add_parser(
        "watch",
        help="live table of every device's latency, merged across the fleet",
        description="Subscribe to <prefix>/+/# and show per-device and fleet-wide latency "
        "from merged histograms, with seq gaps and duplicates.",
    )
    w.add_argument("--broker", required=True, metavar="HOST:PORT")
    w.add_argument("--tls", action="store_true", help="use TLS (system CAs unless --ca-file)")
    w.add_argument("--ca-file", metavar="PEM")
    w.add_argument("--cert-file", metavar="PEM", help="client certificate (mutual TLS)")
    w.add_argument("--key-file", metavar="PEM")
    w.add_argument("--username")
    w.add_argument("--password", help="prefer EDGE_AGENT_FLEET_PASSWORD in the environment")
    w.add_argument("--prefix", default="edge/v1", help="the devices' mqtt.topic_prefix, any number of levels")
    w.add_argument("--metric", default="ttft_ms", help="latency metric for the P95/P99 columns (default ttft_ms)")
    w.add_argument("--workload", default="llm")
    w.add_argument("--window-s", type=float, default=60.0, help="merge windows received in the last S seconds")
    w.add_argument("--refresh-s", type=float, default=2.0)
    w.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    w.add_argument(
        "--json",
        action="store_true",
        help="JSON instead of a table: one object at the end with --duration or --once, else one line per refresh",
    )
    w.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot after --settle-s (retained state and reported arrive at once), then exit",
    )
    w.add_argument(
        "--settle-s",
        type=float,
        default=1.5,
        metavar="S",
        help="with --once: how long to collect messages before the snapshot (default 1.5)",
    )
    w.set_defaults(func=cmd_watch)
    add_signing_commands(fsub)  # keygen and sign: signed commands and desired (docs/telemetry.md)
    add_export_commands(fsub)  # export (Prometheus, OTLP) and simulate


def _parse_broker(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError([("--broker", f"expected HOST:PORT, got {value!r}")])
    return host.strip("[]"), int(port)


def view_from_args(args: argparse.Namespace) -> FleetView:
    """The ``FleetView`` ``fleet watch`` feeds: its window, metric, workload and topic prefix from the flags."""
    return FleetView(window_s=args.window_s, metric=args.metric, workload=args.workload, prefix=args.prefix)


def cmd_watch(args: argparse.Namespace) -> int:
    import os
    import ssl

    import paho.mqtt.client as mqtt

    host, port = _parse_broker(args.broker)
    if args.once:  # one snapshot at the end, like --duration, after the retained messages have arrived
        args.duration = args.settle_s
    view = view_from_args(args)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.suppress_exceptions = True
    password = args.password or os.environ.get("EDGE_AGENT_FLEET_PASSWORD")
    if args.username:
        client.username_pw_set(args.username, password)
    if args.tls or args.ca_file or args.cert_file:
        if (args.cert_file is None) != (args.key_file is None):
            raise ConfigError([("--cert-file", "--cert-file and --key-file go together")])
        client.tls_set(
            ca_certs=args.ca_file,
            certfile=args.cert_file,
            keyfile=args.key_file,
            cert_reqs=ssl.CERT_REQUIRED,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
    topic = f"{args.prefix}/+/#"
    errors: list[str] = []

    def on_connect(c: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        if getattr(rc, "is_failure", False):
            errors.append(f"broker refused the connection: {rc}")
            return
        c.subscribe(topic, qos=1)

    client.on_connect = on_connect
    client.on_message = lambda _c, _u, m: view.ingest(m.topic, bytes(m.payload))
    try:
        client.connect(host, port, keepalive=20)
    except (OSError, ssl.SSLError) as exc:
        raise EdgeAgentError(f"cannot connect to broker {host}:{port}: {exc}") from exc
    client.loop_start()
    start = time.monotonic()
    try:
        while args.duration is None or time.monotonic() - start < args.duration:
            if errors:
                raise EdgeAgentError(errors[0])
            time.sleep(min(args.refresh_s, max(0.05, (args.duration or 1e9) - (time.monotonic() - start))))
            if (args.json and args.duration is not None) or args.once:
                continue
            snap = view.rows()
            if args.json:
                print(json.dumps(snap), flush=True)
            else:
                if sys.stdout.isatty():
                    sys.stdout.write("\x1b[2J\x1b[H")
                print(f"{topic} on {host}:{port}  ({time.strftime('%H:%M:%S')})\n{render_table(snap)}\n", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        client.disconnect()
        client.loop_stop()
    if args.json and args.duration is not None:
        print(json.dumps(view.rows(), indent=2))
    elif args.once:
        print(render_table(view.rows()))
    return 0
