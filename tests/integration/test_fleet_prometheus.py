"""A real Prometheus scrapes ``edge-agent fleet export`` while simulated devices publish through a real
mosquitto; the fleet P95 read back through Prometheus' HTTP API agrees with the P95 of the merged
histograms and with the pooled raw samples, each within its documented error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edge_agent.metrics.window import nearest_rank
from edge_agent.telemetry.schema import LatencyWindow
from edge_agent.telemetry.simulate import SimDevice
from tests.mqtt_broker import Broker, free_port, wait_for, wait_port

PROMETHEUS = shutil.which("prometheus")
LE_SCALE = 3
QUERY = 'histogram_quantile(0.95, sum by (le) (edge_fleet_latency_ms_bucket{metric="ttft_ms"}))'

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed (apt-get install prometheus)"),
]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _child(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_prometheus_reads_the_fleet_p95_from_the_exporter(tmp_path):
    broker = Broker(tmp_path / "mq").start()
    export_port, prom_port = free_port(), free_port()
    exporter = _child(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "fleet",
            "export",
            "--broker",
            f"127.0.0.1:{broker.port}",
            "--listen",
            f"127.0.0.1:{export_port}",
            "--le-scale",
            str(LE_SCALE),
        ],
        tmp_path / "export.log",
    )
    prom = None
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sim-test", protocol=mqtt.MQTTv5)
    try:
        wait_port(export_port, 30)
        time.sleep(1.0)  # the exporter's subscription is in place before anything is published
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        devices = [SimDevice(f"dev-{d}", seed=d, requests_per_window=40, keep_samples=True) for d in range(5)]
        direct = None
        for dev in devices:
            for suffix, payload in dev.retained():
                client.publish(f"edge/v1/{dev.device_id}/{suffix}", payload, qos=1, retain=True).wait_for_publish(5)
            for _ in range(3):
                payload = dev.window()
                client.publish(f"edge/v1/{dev.device_id}/tele/latency", payload, qos=1).wait_for_publish(5)
                for s in LatencyWindow.model_validate_json(payload).series:
                    h = s.histograms["ttft_ms"].to_histogram()
                    if direct is None:
                        direct = h
                    else:
                        direct.merge(h)
        pooled = sorted(v for dev in devices for v in dev.samples or [])
        assert direct is not None and direct.count == len(pooled) == 600

        def exported_count() -> bool:
            text = _get(f"http://127.0.0.1:{export_port}/metrics")
            counts = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("edge_fleet_latency_ms_count") and 'metric="ttft_ms"' in line
            ]
            return sum(counts) == len(pooled)

        wait_for(exported_count, 30, 0.2, "the exporter to hold every window")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: fleet\n    static_configs:\n      - targets: ['127.0.0.1:{export_port}']\n"
        )
        prom = _child(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            tmp_path / "prometheus.log",
        )
        wait_port(prom_port, 60)
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": QUERY})

        def answer() -> float | None:
            try:
                body = json.loads(_get(url))
            except OSError:
                return None
            result = body.get("data", {}).get("result", [])
            return float(result[0]["value"][1]) if result else None

        prom_p95 = wait_for(answer, 60, 0.5, "Prometheus to answer the fleet P95")
    finally:
        client.loop_stop()
        client.disconnect()
        if prom is not None:
            _stop(prom)
        _stop(exporter)
        broker.stop()
    true_p95 = nearest_rank(pooled, 95)
    direct_p95 = direct.quantile(0.95)
    classic_bound = 2 ** (2**-LE_SCALE) - 1  # histogram_quantile's interpolation inside one classic bucket
    print(
        f"\nquery: {QUERY}\nprometheus: {prom_p95:.3f} ms  merged histogram: {direct_p95:.3f} ms "
        f"(scale {direct.scale}, ±{direct.relative_error:.1%})  pooled raw samples: {true_p95:.3f} ms"
    )
    assert abs(direct_p95 - true_p95) / true_p95 <= direct.relative_error
    assert abs(prom_p95 - true_p95) / true_p95 <= classic_bound
    assert abs(prom_p95 - direct_p95) / direct_p95 <= classic_bound + direct.relative_error
