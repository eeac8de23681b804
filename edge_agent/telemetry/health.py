"""Device health read from procfs and sysfs: what explains a latency window besides the load.

``HealthReader(root).snapshot()`` returns one flat dict (``schema.Health`` takes it as is): the
process's CPU % and RSS, system memory and load, temperatures (thermal zones, hwmon), CPU frequency
and thermal-throttle counters, the Jetson power mode (``nvpmodel -q``) and INA3221 rails, Intel RAPL
power, and NPU frequency and busy share. Every source is optional: one that is missing or unreadable
is named in ``absent`` and its fields stay None, never an error. Rates (CPU %, RAPL watts, NPU busy)
are deltas since the reader's previous snapshot, so each consumer (a telemetry window, a Prometheus
scrape) keeps a reader of its own.

Every path is read under ``root`` (default "/"), so tests point it at a fake tree.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NVPMODEL_EVERY_S = 60.0  # the power mode changes by hand, not per window: one subprocess a minute at most


def _text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # missing, unreadable (RAPL is root-only on recent kernels), or a vanished hwmon
        return None


def _number(path: Path) -> float | None:
    raw = _text(path)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


class HealthReader:
    """Reads one health snapshot per call (see the module doc); not thread-safe: one per consumer."""

    def __init__(
        self,
        root: str | Path = "/",
        clock: Callable[[], float] = time.monotonic,
        cpu_times: Callable[[], float] | None = None,
        which: Callable[[str], str | None] = shutil.which,
    ) -> None:
        self.root = Path(root)
        self.clock, self.which = clock, which
        self.cpu_times = cpu_times or (lambda: sum(os.times()[:2]))
        self._last_cpu = (self.clock(), self.cpu_times())
        self._last_energy: dict[str, tuple[float, float]] = {}
        self._last_busy: dict[str, tuple[float, float]] = {}
        self._power_mode: tuple[float, str | None] | None = None

    def _p(self, rel: str) -> Path:
        return self.root / rel

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        absent: list[str] = []
        for name, read in (
            ("process", self._process),
            ("memory", self._memory),
            ("load", self._load),
            ("thermal_zones", self._thermal_zones),
            ("hwmon", self._hwmon),
            ("cpufreq", self._cpufreq),
            ("thermal_throttle", self._throttle),
            ("nvpmodel", self._nvpmodel),
            ("ina3221", self._rails),
            ("rapl", self._rapl),
            ("npu", self._npu),
        ):
            try:
                fields = read()
            except Exception:  # a strange sysfs must not cost a window: the source is reported absent
                log.debug("health source %s failed", name, exc_info=True)
                fields = None
            if fields:
                for key, value in fields.items():
                    if key == "temperatures_c":
                        out.setdefault(key, {}).update(value)
                    else:
                        out[key] = value
            else:
                absent.append(name)
        temps = out.get("temperatures_c")
        out["max_temp_c"] = max(temps.values()) if temps else None
        out["absent"] = absent
        return out

    def max_temp_c(self) -> float | None:
        """The hottest sensor now (thermal zones and hwmon), for the tier policy; None when none is readable."""
        temps = {
            **(self._thermal_zones() or {}).get("temperatures_c", {}),
            **(self._hwmon() or {}).get("temperatures_c", {}),
        }
        return max(temps.values()) if temps else None

    # -- sources: each returns its fields, or None when absent ---------------------------------------

    def _process(self) -> dict[str, Any] | None:
        now, cpu = self.clock(), self.cpu_times()
        then, cpu_then = self._last_cpu
        self._last_cpu = (now, cpu)
        out: dict[str, Any] = {}
        if now > then:  # percent of one core, as top shows it (above 100 on several cores)
            out["process_cpu_percent"] = round(100.0 * (cpu - cpu_then) / (now - then), 2)
        statm = _text(self._p("proc/self/statm"))
        if statm and len(statm.split()) > 1:
            out["process_rss_bytes"] = int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return out or None

    def _memory(self) -> dict[str, Any] | None:
        text = _text(self._p("proc/meminfo"))
        if not text:
            return None
        kib = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if rest.split() and rest.split()[0].isdigit():
                kib[key] = int(rest.split()[0]) * 1024
        if "MemTotal" not in kib:
            return None
        return {"memory_total_bytes": kib["MemTotal"], "memory_available_bytes": kib.get("MemAvailable")}

    def _load(self) -> dict[str, Any] | None:
        parts = (_text(self._p("proc/loadavg")) or "").split()
        if len(parts) < 3:
            return None
        return {"load_1m": float(parts[0]), "load_5m": float(parts[1]), "load_15m": float(parts[2])}

    def _thermal_zones(self) -> dict[str, Any] | None:
        temps = {}
        for zone in sorted(self._p("sys/class/thermal").glob("thermal_zone*")):
            milli = _number(zone / "temp")
            if milli is None or milli <= -273_000:  # a disabled zone reads an error or absolute zero
                continue
            kind = _text(zone / "type") or zone.name
            temps[f"{kind}" if kind not in temps else f"{kind}.{zone.name}"] = round(milli / 1000.0, 2)
        return {"temperatures_c": temps} if temps else None

    def _hwmon(self) -> dict[str, Any] | None:
        temps = {}
        for mon in sorted(self._p("sys/class/hwmon").glob("hwmon*")):
            chip = _text(mon / "name") or mon.name
            for sensor in sorted(mon.glob("temp*_input")):
                milli = _number(sensor)
                if milli is None:
                    continue
                label = _text(mon / sensor.name.replace("_input", "_label")) or sensor.name.split("_")[0]
                temps[f"{chip}/{label}"] = round(milli / 1000.0, 2)
        return {"temperatures_c": temps} if temps else None

    def _cpufreq(self) -> dict[str, Any] | None:
        khz = [
            v
            for p in sorted(self._p("sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"))
            if (v := _number(p)) is not None
        ]
        if not khz:
            return None
        return {
            "cpu_freq_mhz_mean": round(sum(khz) / len(khz) / 1000.0, 1),
            "cpu_freq_mhz_min": round(min(khz) / 1000.0, 1),
            "cpu_freq_mhz_max": round(max(khz) / 1000.0, 1),
        }

    def _throttle(self) -> dict[str, Any] | None:
        counts: dict[str, int] = {}
        for path in self._p("sys/devices/system/cpu").glob("cpu[0-9]*/thermal_throttle/*_throttle_count"):
            value = _number(path)
            if value is not None:
                kind = path.name.removesuffix("_throttle_count")  # core, package
                counts[kind] = counts.get(kind, 0) + int(value)
        return {"throttle_counts": counts} if counts else None

    def _nvpmodel(self) -> dict[str, Any] | None:
        now = self.clock()
        if self._power_mode is None or now - self._power_mode[0] >= NVPMODEL_EVERY_S:
            self._power_mode = (now, self._query_nvpmodel())
        mode = self._power_mode[1]
        return {"power_mode": mode} if mode else None

    def _query_nvpmodel(self) -> str | None:
        binary = self.which("nvpmodel")
        if binary is None:
            return None
        try:
            out = subprocess.run([binary, "-q"], capture_output=True, text=True, timeout=2.0, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in out.stdout.splitlines():  # "NV Power Mode: MAXN" then the mode number
            if "Power Mode" in line and ":" in line:
                return line.split(":", 1)[1].strip() or None
        return None

    def _rails(self) -> dict[str, Any] | None:
        rails: dict[str, float] = {}
        # L4T up to R32: the ina3221x IIO driver, in_power<N>_input in mW with rail_name_<N>.
        for dev in sorted(self._p("sys/bus/i2c/drivers/ina3221x").glob("*/iio:device*")):
            for power in sorted(dev.glob("in_power*_input")):
                index = power.name.removeprefix("in_power").removesuffix("_input")
                milliwatts = _number(power)
                if milliwatts is not None:
                    rails[_text(dev / f"rail_name_{index}") or f"{dev.name}.{index}"] = round(milliwatts / 1000.0, 3)
        # R34 and later: hwmon "ina3221", in<N>_input mV and curr<N>_input mA per labelled channel.
        for mon in sorted(self._p("sys/class/hwmon").glob("hwmon*")):
            if (_text(mon / "name") or "") != "ina3221":
                continue
            for volts in sorted(mon.glob("in[0-9]*_input")):
                index = volts.name.removeprefix("in").removesuffix("_input")
                mv, ma = _number(volts), _number(mon / f"curr{index}_input")
                label = _text(mon / f"in{index}_label")
                if mv is not None and ma is not None and label and not label.lower().startswith("sum"):
                    rails[label] = round(mv * ma / 1e6, 3)
        return {"rails_w": rails} if rails else None

    def _rapl(self) -> dict[str, Any] | None:
        now, watts = self.clock(), {}
        seen = False
        for zone in sorted(self._p("sys/class/powercap").glob("intel-rapl:*")):
            energy = _number(zone / "energy_uj")
            if energy is None:
                continue
            seen = True
            name = f"{_text(zone / 'name') or 'rapl'}.{zone.name.removeprefix('intel-rapl:')}"
            last = self._last_energy.get(name)
            self._last_energy[name] = (now, energy)
            if last is not None and now > last[0] and energy >= last[1]:  # a wrapped counter skips one reading
                watts[name] = round((energy - last[1]) / 1e6 / (now - last[0]), 3)
        return {"rapl_power_w": watts} if seen else None

    def _npu(self) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        now = self.clock()
        for dev in sorted(self._p("sys/class/accel").glob("accel*")):
            base = dev / "device"
            freq = _number(base / "npu_current_frequency_mhz")
            if freq is not None:
                out["npu_freq_mhz"] = freq
            busy = _number(base / "npu_busy_time_us")
            if busy is not None:
                last = self._last_busy.get(dev.name)
                self._last_busy[dev.name] = (now, busy)
                out.setdefault("npu_busy_percent", None)
                if last is not None and now > last[0]:
                    share = (busy - last[1]) / 1e6 / (now - last[0])
                    out["npu_busy_percent"] = round(min(100.0, max(0.0, 100.0 * share)), 2)
        return out or None
