"""``edge-agent fleet watch``: a live fleet table from ``edge/v1/+/#``, with merged histograms.

Per device: online/offline (``state``, incl. the Last Will), active tier, TTFT P95/P99 read from the
device's histograms merged over the last ``window_s`` seconds of *live* windows, throughput, and
``seq`` bookkeeping: a duplicate (at-least-once delivery) is counted and ignored, a missing number
is a gap until a replayed (``historical``) window fills it. The fleet row merges every device's
histograms (never averaging percentiles); its error bound is that of the merged histogram's scale.

``FleetView`` is pure (time injected, ``ingest`` never raises); the CLI wraps it in a paho client.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError, EdgeAgentError
from ..metrics.histogram import ExponentialHistogram
from .schema import Event, LatencyWindow, State

log = logging.getLogger(__name__)

MAX_MISSING = 100_000
MAX_WINDOWS_PER_DEVICE = 4096


class SeqTracker:
    """Gaps and duplicates of one device's ``seq`` stream (monotonic across its restarts)."""

    def __init__(self) -> None:
        self.high = 0
        self.missing: set[int] = set()
        self.duplicates = 0
        self.received = 0
        self.missing_overflow = 0

    def add(self, seq: int) -> bool:
        """True when ``seq`` is new (use the window), False for a duplicate."""
        if seq > self.high:
            if self.high:  # the first number seen is where this watch starts: nothing before it is a gap
                gap = range(self.high + 1, seq)
                if len(self.missing) + len(gap) > MAX_MISSING:
                    self.missing_overflow += len(gap)
                else:
                    self.missing.update(gap)
            self.high = seq
        elif seq in self.missing:
            self.missing.discard(seq)
        else:
            self.duplicates += 1
            return False
        self.received += 1
        return True

    @property
    def gaps(self) -> int:
        return len(self.missing) + self.missing_overflow


@dataclass
class DeviceView:
    device_id: str
    state: str = "unknown"
    session: int | None = None
    tiers: dict[str, str] = field(default_factory=dict)
    seq: SeqTracker = field(default_factory=SeqTracker)
    # (received at, {metric: histogram}, requests, tokens, duration_s) of live windows
    windows: deque = field(default_factory=lambda: deque(maxlen=MAX_WINDOWS_PER_DEVICE))
    historical: int = 0
    events: dict[str, int] = field(default_factory=dict)
    last_seen: float | None = None


class FleetView:
    def __init__(self, window_s: float = 60.0, metric: str = "ttft_ms", workload: str = "llm",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.metric, self.workload, self.clock = window_s, metric, workload, clock
        self.devices: dict[str, DeviceView] = {}
        self.malformed = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def ingest(self, topic: str, payload: bytes) -> None:
        """One MQTT message. Malformed payloads are counted (``malformed``) and described, never raised."""
        parts = topic.split("/")
        if len(parts) < 4:
            return
        device_id, kind = parts[2], "/".join(parts[3:])
        try:
            with self._lock:
                self._ingest(device_id, kind, payload)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            self.malformed += 1
            self.last_error = f"{topic}: {str(exc).splitlines()[0][:200]}"
            log.warning("malformed message on %s: %s", topic, exc)

    def _device(self, device_id: str) -> DeviceView:
        dev = self.devices.get(device_id)
        if dev is None:
            dev = self.devices[device_id] = DeviceView(device_id)
        return dev

    def _ingest(self, device_id: str, kind: str, payload: bytes) -> None:
        if kind == "state":
            if not payload:
                return
            st = State.model_validate_json(payload)
            dev = self._device(device_id)
            dev.state, dev.session = st.state, st.session
        elif kind == "tele/latency":
            win = LatencyWindow.model_validate_json(payload)
            dev = self._device(device_id)
            dev.last_seen = self.clock()
            if not dev.seq.add(win.seq):
                return
            if win.historical:
                dev.historical += 1
                return
            hists: dict[str, ExponentialHistogram] = {}
            requests = tokens = 0
            for s in win.series:
                if s.workload != self.workload:
                    continue
                dev.tiers[s.workload] = s.tier
                requests += s.requests
                tokens += s.tokens_out
                for metric, h in s.histograms.items():
                    hist = h.to_histogram()
                    if metric in hists:
                        hists[metric].merge(hist)
                    else:
                        hists[metric] = hist
            dev.windows.append((self.clock(), hists, requests, tokens, win.window.duration_s))
        elif kind.startswith("evt/"):
            ev = Event.model_validate_json(payload)
            dev = self._device(device_id)
            dev.events[ev.type] = dev.events.get(ev.type, 0) + 1

    # -- views ------------------------------------------------------------------------------------

    def _recent(self, dev: DeviceView, now: float) -> tuple[ExponentialHistogram | None, float, float]:
        merged: ExponentialHistogram | None = None
        requests = tokens = 0
        duration = 0.0
        for at, hists, req, tok, dur in dev.windows:
            if now - at > self.window_s:
                continue
            requests, tokens, duration = requests + req, tokens + tok, duration + dur
            h = hists.get(self.metric)
            if h is not None:
                if merged is None:
                    merged = h.copy()
                else:
                    merged.merge(h)
        return merged, (requests / duration if duration else 0.0), (tokens / duration if duration else 0.0)

    def rows(self) -> dict[str, Any]:
        now = self.clock()
        out = []
        fleet: ExponentialHistogram | None = None
        fleet_rps = fleet_tps = 0.0
        with self._lock:
            for dev in sorted(self.devices.values(), key=lambda d: d.device_id):
                hist, rps, tps = self._recent(dev, now)
                if hist is not None:
                    if fleet is None:
                        fleet = hist.copy()
                    else:
                        fleet.merge(hist)
                fleet_rps, fleet_tps = fleet_rps + rps, fleet_tps + tps
                out.append({"device": dev.device_id, "state": dev.state, "session": dev.session,
                            "tier": dev.tiers.get(self.workload), **_quantiles(hist),
                            "requests_per_s": round(rps, 3), "tokens_per_s": round(tps, 3),
                            "windows": dev.seq.received, "historical": dev.historical,
                            "gaps": dev.seq.gaps, "duplicates": dev.seq.duplicates, "seq_high": dev.seq.high,
                            "events": dict(dev.events)})
        online = sum(1 for r in out if r["state"] == "online")
        fleet_row = {"devices": len(out), "online": online, **_quantiles(fleet),
                     "requests_per_s": round(fleet_rps, 3), "tokens_per_s": round(fleet_tps, 3),
                     "gaps": sum(r["gaps"] for r in out), "duplicates": sum(r["duplicates"] for r in out)}
        return {"metric": self.metric, "window_s": self.window_s, "devices": out, "fleet": fleet_row,
                "malformed": self.malformed, "last_error": self.last_error}

    def fleet_histogram(self) -> ExponentialHistogram | None:
        now = self.clock()
        merged: ExponentialHistogram | None = None
        with self._lock:
            for dev in self.devices.values():
                h, _r, _t = self._recent(dev, now)
                if h is None:
                    continue
                if merged is None:
                    merged = h.copy()
                else:
                    merged.merge(h)
        return merged


def _quantiles(hist: ExponentialHistogram | None) -> dict[str, Any]:
    if hist is None or hist.count == 0:
        return {"p95_ms": None, "p99_ms": None, "count": 0, "relative_error": None}
    return {"p95_ms": round(hist.quantile(0.95), 3), "p99_ms": round(hist.quantile(0.99), 3),
            "count": hist.count, "relative_error": round(hist.relative_error, 5)}


def render_table(view: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
    m = view["metric"].removesuffix("_ms").upper()
    head = (f"{'DEVICE':<20} {'STATE':<8} {'TIER':<8} {m + ' P95':>9} {m + ' P99':>9} {'N':>6} "
            f"{'REQ/S':>7} {'TOK/S':>8} {'GAPS':>5} {'DUPS':>5}")
    lines = [head]
    for r in view["devices"]:
        lines.append(f"{r['device'][:20]:<20} {r['state']:<8} {f(r['tier'])[:8]:<8} {f(r['p95_ms']):>9} "
                     f"{f(r['p99_ms']):>9} {r['count']:>6} {r['requests_per_s']:>7.2f} {r['tokens_per_s']:>8.1f} "
                     f"{r['gaps']:>5} {r['duplicates']:>5}")
    fl = view["fleet"]
    err = f" (±{fl['relative_error'] * 100:.1f} %)" if fl["relative_error"] is not None else ""
    lines.append(f"{'FLEET (' + str(fl['online']) + '/' + str(fl['devices']) + ' online)':<29} "
                 f"{f(fl['p95_ms']):>9} {f(fl['p99_ms']):>9} {fl['count']:>6} {fl['requests_per_s']:>7.2f} "
                 f"{fl['tokens_per_s']:>8.1f} {fl['gaps']:>5} {fl['duplicates']:>5}{err}")
    if view["malformed"]:
        lines.append(f"{view['malformed']} malformed messages ignored; last: {view['last_error']}")
    return "\n".join(lines)


# -- CLI --------------------------------------------------------------------------------------------

def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("fleet", help="fleet tools: watch devices' telemetry over MQTT, sign commands")
    fsub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    w = fsub.add_parser("watch", help="live table of every device's latency, merged across the fleet",
                        description="Subscribe to <prefix>/+/# and show per-device and fleet-wide latency "
                                    "from merged histograms, with seq gaps and duplicates.")
    w.add_argument("--broker", required=True, metavar="HOST:PORT")
    w.add_argument("--tls", action="store_true", help="use TLS (system CAs unless --ca-file)")
    w.add_argument("--ca-file", metavar="PEM")
    w.add_argument("--cert-file", metavar="PEM", help="client certificate (mutual TLS)")
    w.add_argument("--key-file", metavar="PEM")
    w.add_argument("--username")
    w.add_argument("--password", help="prefer EDGE_AGENT_FLEET_PASSWORD in the environment")
    w.add_argument("--prefix", default="edge/v1")
    w.add_argument("--metric", default="ttft_ms", help="latency metric for the P95/P99 columns (default ttft_ms)")
    w.add_argument("--workload", default="llm")
    w.add_argument("--window-s", type=float, default=60.0, help="merge windows received in the last S seconds")
    w.add_argument("--refresh-s", type=float, default=2.0)
    w.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    w.add_argument("--json", action="store_true",
                   help="JSON instead of a table: one object at the end with --duration, else one line per refresh")
    w.set_defaults(func=cmd_watch)
    from .signing import add_cli  # keygen and sign: signed commands and desired (docs/telemetry.md)

    add_cli(fsub)


def _parse_broker(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError([("--broker", f"expected HOST:PORT, got {value!r}")])
    return host.strip("[]"), int(port)


def cmd_watch(args: argparse.Namespace) -> int:
    import os
    import ssl

    import paho.mqtt.client as mqtt

    host, port = _parse_broker(args.broker)
    view = FleetView(window_s=args.window_s, metric=args.metric, workload=args.workload)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.suppress_exceptions = True
    password = args.password or os.environ.get("EDGE_AGENT_FLEET_PASSWORD")
    if args.username:
        client.username_pw_set(args.username, password)
    if args.tls or args.ca_file or args.cert_file:
        if (args.cert_file is None) != (args.key_file is None):
            raise ConfigError([("--cert-file", "--cert-file and --key-file go together")])
        client.tls_set(ca_certs=args.ca_file, certfile=args.cert_file, keyfile=args.key_file,
                       cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
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
            if args.json and args.duration is not None:
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
    return 0
