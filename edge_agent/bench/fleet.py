"""``edge-agent bench fleet``: the fleet side at 100 and 1,000 devices (messages/s, lag, CPU).

Per device count, on one machine and one mosquitto (started on a free loopback port):

- ``edge-agent fleet simulate`` publishes N devices' windows every ``--interval-s`` (its own process);
- ``edge-agent fleet export`` ingests them (its own process): its CPU comes from ``/proc/<pid>/stat``,
  its lag from its own ``edge_fleet_export_ingest_lag_seconds`` plus the time a ``/metrics`` scrape
  takes (what Prometheus waits for the data to be reflected);
- the ``fleet watch`` core (``FleetView``) ingests them in a third process (this command with the
  hidden ``--role watch``), which reports its messages, lag (receive minus the window's end on the
  shared wall clock) and CPU.

The three processes and the broker share the machine's cores, so the figures are an upper bound
for one box doing everything; the ratios between rows are what to read. Each count runs
``--rounds`` times and the medians are printed.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable
from .netproxy import free_port
from .options import FleetOptions

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def watch_role(broker: str, warmup_s: float, duration_s: float) -> int:
    """The ``fleet watch`` core alone on ``broker`` (HOST:PORT): ingest for warmup + duration, then print stats
    as one JSON line (what ``run`` starts in a process of its own, as ``bench fleet --role watch``)."""
    import paho.mqtt.client as mqtt

    from ..telemetry.fleet import FleetView

    host, _, port = broker.rpartition(":")
    view = FleetView(window_s=60.0)
    lags: list[float] = []
    state = {"measuring": False, "messages": 0}

    def on_message(_c: object, _u: object, m: Any) -> None:
        view.ingest(m.topic, bytes(m.payload))
        if state["measuring"] and m.topic.endswith("/tele/latency"):
            state["messages"] += 1
            end = json.loads(m.payload)["window"]["end_wall"]
            lags.append(time.time() - end)

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, *_: c.subscribe("edge/v1/+/#", qos=1)
    client.on_message = on_message
    client.connect(host, int(port))
    client.loop_start()
    time.sleep(warmup_s)
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    state["measuring"] = True
    time.sleep(duration_s)
    state["measuring"] = False
    cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    view.rows()  # the table's aggregation is part of watch's cost
    client.disconnect()
    client.loop_stop()
    lags.sort()
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(
        json.dumps(
            {
                "messages": state["messages"],
                "elapsed_s": t1 - t0,
                "cpu_s": cpu,
                "lag_p50_s": lags[len(lags) // 2] if lags else None,
                "lag_p95_s": lags[int(len(lags) * 0.95)] if lags else None,
            }
        ),
        flush=True,
    )
    return 0


def _metrics(port: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return text, time.perf_counter() - t0


def _gauge(text: str, prefix: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


def _one_run(n: int, opts: FleetOptions, work: Path) -> dict[str, Any]:
    """One run at ``n`` devices: broker, exporter, watch and simulator started, the exporter measured, all stopped."""
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(mosquitto).exists():
        raise BackendUnavailable("bench fleet needs mosquitto (apt-get install mosquitto)")
    mq_port, ex_port = free_port(), free_port()
    conf = work / f"mosquitto-{n}.conf"
    conf.write_text(f"listener {mq_port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 100000\n")
    broker = f"127.0.0.1:{mq_port}"
    procs: list[subprocess.Popen] = []
    log = (work / f"children-{n}.log").open("ab")
    try:
        procs.append(subprocess.Popen([mosquitto, "-c", str(conf)], stdout=log, stderr=log))
        time.sleep(0.5)
        exporter, watch, sim = _start_fleet(n, opts, broker, ex_port, log, procs)
        time.sleep(opts.warmup_s)
        row = _measure_exporter(exporter.pid, ex_port, opts)
        out, _ = watch.communicate(timeout=60)
        w = json.loads(out.decode().strip().splitlines()[-1])
        sim_out, _ = sim.communicate(timeout=60)
        return {
            "devices": n,
            "expected_msgs_per_s": n / opts.interval_s,
            **row,
            "watch_msgs_per_s": w["messages"] / w["elapsed_s"],
            "watch_cpu_pct": 100 * w["cpu_s"] / w["elapsed_s"],
            "watch_lag_p50_s": w["lag_p50_s"],
            "watch_lag_p95_s": w["lag_p95_s"],
            "simulator": sim_out.decode().strip(),
        }
    finally:
        _stop(procs)
        log.close()


def _start_fleet(
    n: int, opts: FleetOptions, broker: str, ex_port: int, log: Any, procs: list[subprocess.Popen]
) -> tuple[subprocess.Popen, subprocess.Popen, subprocess.Popen]:
    """``fleet export``, the watch role and ``fleet simulate`` (``n`` devices) on ``broker``, each added to
    ``procs`` as it starts (so a failure part way still stops what started)."""
    py = [sys.executable, "-m", "edge_agent"]
    exporter = subprocess.Popen(
        [*py, "fleet", "export", "--broker", broker, "--listen", f"127.0.0.1:{ex_port}"], stdout=log, stderr=log
    )
    procs.append(exporter)
    total = opts.warmup_s + opts.duration_s
    watch = subprocess.Popen(
        [
            *py,
            "bench",
            "fleet",
            "--role",
            "watch",
            "--broker",
            broker,
            "--warmup-s",
            str(opts.warmup_s),
            "--duration-s",
            str(opts.duration_s),
        ],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    procs.append(watch)
    time.sleep(1.5)
    sim = subprocess.Popen(
        [
            *py,
            "fleet",
            "simulate",
            "--broker",
            broker,
            "--devices",
            str(n),
            "--interval-s",
            str(opts.interval_s),
            "--duration-s",
            str(total + 1.0),
        ],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    procs.append(sim)
    return exporter, watch, sim


def _measure_exporter(pid: int, port: int, opts: FleetOptions) -> dict[str, Any]:
    """The exporter over ``duration_s``: messages/s and CPU, its lag plus what a scrape takes, scraped every
    ``scrape_every_s``."""
    text0, _ = _metrics(port)
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    msgs0 = _gauge(text0, 'edge_fleet_export_messages_total{kind="tele/latency"}') or 0.0
    scrapes = []
    while time.monotonic() - t0 < opts.duration_s:
        time.sleep(min(opts.scrape_every_s, max(0.0, opts.duration_s - (time.monotonic() - t0))))
        text, took = _metrics(port)
        scrapes.append(took)
    cpu1, t1 = _cpu_s(pid), time.monotonic()
    msgs1 = _gauge(text, 'edge_fleet_export_messages_total{kind="tele/latency"}') or 0.0
    scrape = statistics.median(scrapes)
    lag50 = _gauge(text, 'edge_fleet_export_ingest_lag_seconds{quantile="0.5"}')
    lag95 = _gauge(text, 'edge_fleet_export_ingest_lag_seconds{quantile="0.95"}')
    return {
        "export_msgs_per_s": (msgs1 - msgs0) / (t1 - t0),
        "export_cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
        "export_lag_p50_s": None if lag50 is None else lag50 + scrape,
        "export_lag_p95_s": None if lag95 is None else lag95 + scrape,
        "scrape_s": scrape,
        "scrape_bytes": len(text),
    }


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes, last started first; kill one that does not exit within 10 s."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(rows: list[dict[str, Any]]) -> str:
    head = (
        "| devices | expected msg/s | export msg/s | export lag P50 / P95 | export CPU | /metrics scrape "
        "| watch msg/s | watch lag P50 / P95 | watch CPU |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['devices']} | {r['expected_msgs_per_s']:.0f} | {r['export_msgs_per_s']:.0f} "
            f"| {_fmt(r['export_lag_p50_s'] and r['export_lag_p50_s'] * 1e3, '.0f')} / "
            f"{_fmt(r['export_lag_p95_s'] and r['export_lag_p95_s'] * 1e3, '.0f')} ms "
            f"| {r['export_cpu_pct']:.0f} % | {r['scrape_s'] * 1e3:.0f} ms, {r['scrape_bytes'] / 1e6:.1f} MB "
            f"| {r['watch_msgs_per_s']:.0f} | {_fmt(r['watch_lag_p50_s'] and r['watch_lag_p50_s'] * 1e3, '.0f')} / "
            f"{_fmt(r['watch_lag_p95_s'] and r['watch_lag_p95_s'] * 1e3, '.0f')} ms | {r['watch_cpu_pct']:.0f} % |"
        )
    return "\n".join(lines)


def run(opts: FleetOptions) -> int:
    """Per device count, ``rounds`` runs of simulator, exporter and watch on one broker; the medians printed."""
    counts = [int(c) for c in str(opts.devices).split(",") if c.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for n in counts:
            runs = [_one_run(n, opts, Path(tmp)) for _ in range(max(1, opts.rounds))]
            row = dict(runs[0])
            for key, value in runs[0].items():
                if isinstance(value, float):
                    values = [r[key] for r in runs if r[key] is not None]
                    row[key] = statistics.median(values) if values else None
            rows.append(row)
            print(f"{n} devices: {row['simulator']}", file=sys.stderr, flush=True)
    print(render(rows))
    if opts.json_out:
        Path(opts.json_out).write_text(
            json.dumps({"interval_s": opts.interval_s, "duration_s": opts.duration_s, "rows": rows}, indent=2)
        )
    return 0
