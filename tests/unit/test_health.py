"""Device health from fake procfs/sysfs trees: a Jetson-like one, an Intel-like one, an empty one."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from edge_agent.telemetry.health import HealthReader
from edge_agent.telemetry.schema import SCHEMA_DIR, Health

SOURCES = {
    "process",
    "memory",
    "load",
    "thermal_zones",
    "hwmon",
    "cpufreq",
    "thermal_throttle",
    "nvpmodel",
    "ina3221",
    "rapl",
    "npu",
}


def put(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def common(root: Path) -> None:
    put(root, "proc/meminfo", "MemTotal:        8000000 kB\nMemFree:   100 kB\nMemAvailable:    3000000 kB\n")
    put(root, "proc/loadavg", "1.50 0.75 0.25 2/345 6789\n")
    put(root, "proc/self/statm", "50000 12000 3000 1 0 20000 0\n")


@pytest.fixture
def jetson(tmp_path: Path) -> Path:
    common(tmp_path)
    for i, (kind, milli) in enumerate((("cpu-thermal", 51500), ("gpu-thermal", 48250), ("tj-thermal", 52000))):
        put(tmp_path, f"sys/class/thermal/thermal_zone{i}/type", kind + "\n")
        put(tmp_path, f"sys/class/thermal/thermal_zone{i}/temp", f"{milli}\n")
    for cpu, khz in enumerate((1_510_400, 1_190_400)):
        put(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq", f"{khz}\n")
    # The R35+ hwmon layout of the INA3221: in<N>_input mV, curr<N>_input mA, labelled channels.
    mon = "sys/class/hwmon/hwmon1"
    put(tmp_path, f"{mon}/name", "ina3221\n")
    for n, (label, mv, ma) in enumerate(
        (("VDD_IN", 5000, 1200), ("VDD_CPU_GPU_CV", 5000, 400), ("sum of shunt voltages", 1, 1)), start=1
    ):
        put(tmp_path, f"{mon}/in{n}_label", label + "\n")
        put(tmp_path, f"{mon}/in{n}_input", f"{mv}\n")
        put(tmp_path, f"{mon}/curr{n}_input", f"{ma}\n")
    return tmp_path


@pytest.fixture
def intel(tmp_path: Path) -> Path:
    common(tmp_path)
    put(tmp_path, "sys/class/hwmon/hwmon0/name", "coretemp\n")
    put(tmp_path, "sys/class/hwmon/hwmon0/temp1_label", "Package id 0\n")
    put(tmp_path, "sys/class/hwmon/hwmon0/temp1_input", "67000\n")
    put(tmp_path, "sys/class/hwmon/hwmon0/temp2_input", "61000\n")  # no label: named after the sensor
    for cpu in range(2):
        base = f"sys/devices/system/cpu/cpu{cpu}"
        put(tmp_path, f"{base}/cpufreq/scaling_cur_freq", "2400000\n")
        put(tmp_path, f"{base}/thermal_throttle/core_throttle_count", f"{cpu + 2}\n")
        put(tmp_path, f"{base}/thermal_throttle/package_throttle_count", "7\n")
    put(tmp_path, "sys/class/powercap/intel-rapl:0/name", "package-0\n")
    put(tmp_path, "sys/class/powercap/intel-rapl:0/energy_uj", "1000000\n")
    put(tmp_path, "sys/class/accel/accel0/device/npu_current_frequency_mhz", "1400\n")
    put(tmp_path, "sys/class/accel/accel0/device/npu_busy_time_us", "0\n")
    return tmp_path


def validate(doc: dict) -> None:
    """The snapshot is a valid ``health`` of the checked-in tele_latency JSON Schema."""
    schema = json.loads((SCHEMA_DIR / "tele_latency.json").read_text())
    sub = {**schema["$defs"]["Health"], "$defs": schema["$defs"]}
    jsonschema.validate(json.loads(Health.model_validate(doc).model_dump_json()), sub)


def test_jetson_tree_thermal_zones_and_rails_nvpmodel_absent(jetson: Path) -> None:
    reader = HealthReader(jetson, clock=Clock(), which=lambda name: None)
    doc = reader.snapshot()
    validate(doc)
    assert doc["temperatures_c"] == {"cpu-thermal": 51.5, "gpu-thermal": 48.25, "tj-thermal": 52.0}
    assert doc["max_temp_c"] == 52.0
    assert doc["rails_w"] == {"VDD_IN": 6.0, "VDD_CPU_GPU_CV": 2.0}  # W = mV x mA / 1e6; the sum channel left out
    assert doc["cpu_freq_mhz_min"] == 1190.4 and doc["cpu_freq_mhz_max"] == 1510.4
    assert doc["cpu_freq_mhz_mean"] == pytest.approx((1510.4 + 1190.4) / 2, abs=0.1)
    assert doc["memory_total_bytes"] == 8_000_000 * 1024 and doc["memory_available_bytes"] == 3_000_000 * 1024
    assert (doc["load_1m"], doc["load_5m"], doc["load_15m"]) == (1.5, 0.75, 0.25)
    assert doc["process_rss_bytes"] > 0
    assert set(doc["absent"]) == {"nvpmodel", "rapl", "npu", "thermal_throttle", "hwmon"}  # the INA3221 has no temp
    assert doc.get("power_mode") is None


def test_legacy_ina3221x_iio_rails(tmp_path: Path) -> None:
    dev = "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0"
    put(tmp_path, f"{dev}/rail_name_0", "VDD_IN\n")
    put(tmp_path, f"{dev}/in_power0_input", "4321\n")  # mW
    doc = HealthReader(tmp_path, clock=Clock(), which=lambda name: None).snapshot()
    assert doc["rails_w"] == {"VDD_IN": 4.321}


def test_intel_tree_rapl_and_npu_rates_from_deltas(intel: Path) -> None:
    clock = Clock()
    reader = HealthReader(intel, clock=clock, which=lambda name: None)
    first = reader.snapshot()
    validate(first)
    assert first["temperatures_c"] == {"coretemp/Package id 0": 67.0, "coretemp/temp2": 61.0}
    assert first["throttle_counts"] == {"core": 2 + 3, "package": 14}
    assert first["rapl_power_w"] == {}  # one energy reading is no rate yet
    assert first["npu_freq_mhz"] == 1400 and first["npu_busy_percent"] is None
    assert set(first["absent"]) == {"nvpmodel", "ina3221", "thermal_zones"}
    clock.t += 2.0
    put(intel, "sys/class/powercap/intel-rapl:0/energy_uj", str(1_000_000 + 30_000_000))  # 30 J in 2 s
    put(intel, "sys/class/accel/accel0/device/npu_busy_time_us", str(500_000))  # 0.5 s busy in 2 s
    second = reader.snapshot()
    validate(second)
    assert second["rapl_power_w"] == {"package-0.0": 15.0}
    assert second["npu_busy_percent"] == 25.0


def test_unreadable_rapl_is_absent_not_an_error(intel: Path) -> None:
    energy = intel / "sys/class/powercap/intel-rapl:0/energy_uj"
    energy.unlink()
    energy.mkdir()  # reading a directory fails like a root-only file does for a service user
    doc = HealthReader(intel, clock=Clock(), which=lambda name: None).snapshot()
    assert "rapl" in doc["absent"]


def test_empty_tree_everything_absent_no_error(tmp_path: Path) -> None:
    clock = Clock()
    reader = HealthReader(tmp_path, clock=clock, which=lambda name: None)
    clock.t += 1.0
    doc = reader.snapshot()
    validate(doc)
    assert set(doc["absent"]) == SOURCES - {"process"}  # the process's CPU time comes from the kernel, not a file
    assert doc["process_cpu_percent"] >= 0
    assert doc["max_temp_c"] is None
    assert "process_rss_bytes" not in doc


def test_process_cpu_percent_from_cpu_time_delta(tmp_path: Path) -> None:
    clock, cpu = Clock(), [10.0]
    reader = HealthReader(tmp_path, clock=clock, cpu_times=lambda: cpu[0], which=lambda name: None)
    clock.t += 4.0
    cpu[0] += 1.0  # one CPU-second in four wall seconds
    assert reader.snapshot()["process_cpu_percent"] == 25.0


def test_nvpmodel_queried_when_present_and_cached(tmp_path: Path) -> None:
    script = tmp_path / "nvpmodel"
    calls = tmp_path / "calls"
    script.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'NV Power Mode: MAXN'\necho 0\n")
    script.chmod(0o755)
    clock = Clock()
    reader = HealthReader(tmp_path, clock=clock, which=lambda name: str(script))
    assert reader.snapshot()["power_mode"] == "MAXN"
    clock.t += 1.0
    assert reader.snapshot()["power_mode"] == "MAXN"
    assert calls.read_text().count("x") == 1  # one subprocess a minute at most


def test_max_temp_c_for_the_policy(jetson: Path, tmp_path: Path) -> None:
    assert HealthReader(jetson).max_temp_c() == 52.0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert HealthReader(empty).max_temp_c() is None
