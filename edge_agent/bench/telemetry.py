"""``edge-agent bench telemetry``: does fleet telemetry slow inference? Broker up, down and slow.

Each round runs the same requests through the real serving path (``DecoderLM`` + ``LLMScheduler``)
under every condition, in a rotating order so drift on a shared machine spreads evenly:

- **off**: no telemetry at all (the reference);
- **up**: telemetry publishing every ``--interval-s`` to a reachable mosquitto;
- **down**: the broker is unreachable: windows pile up in the spool, paho keeps reconnecting;
- **slow**: the broker sits behind a loopback proxy that delays every chunk by ``--delay-ms``.

The scheduler's ``on_finished`` feeds the telemetry accumulator exactly as the agent does. Reported:
TTFT and E2E P50/P99 per condition (median over rounds) and the P99 ratio against **off**. Noise
on shared cores is about ±10 %: ratios within that are "the same".
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable, InputError
from ..metrics.window import percentile
from .options import CONDITIONS, TelemetryOptions


class _Mosquitto:
    def __init__(self, binary: str | None, workdir: Path) -> None:
        from .netproxy import free_port

        exe = binary or shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(exe).exists():
            raise BackendUnavailable(
                "mosquitto not found: install it (apt install mosquitto) or pass --broker HOST:PORT"
            )
        import os
        import pwd

        self.port = free_port()
        conf = workdir / "mosquitto.conf"
        user = [f"user {pwd.getpwuid(os.geteuid()).pw_name}"] if os.geteuid() == 0 else []
        conf.write_text(
            "\n".join([*user, f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence false"]) + "\n"
        )
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise BackendUnavailable(f"mosquitto did not start on 127.0.0.1:{self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _prompts(lm: Any, n: int, length: int) -> list[list[int]]:
    import numpy as np

    vocab = int(lm.config.get("vocab_size") or 1000)
    special = set(lm.contract.eos_ids) | ({lm.contract.bos_id} if lm.contract.bos_id is not None else set())
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(n):
        ids = [int(v) for v in rng.integers(3, vocab, size=length)]
        out.append([v if v not in special else 3 for v in ids])
    return out


def _run_condition(
    cond: str, lm: Any, prompts: list[list[int]], opts: TelemetryOptions, host: str, port: int, workdir: Path
) -> dict[str, Any]:
    from ..config import MqttConfig, TelemetryConfig
    from ..metrics.timing import RequestTiming
    from ..models.sampling import SamplingParams
    from ..serving.llm.scheduler import Limits, LLMScheduler
    from ..telemetry.service import Telemetry
    from .netproxy import TcpProxy, free_port

    proxy = None
    tele = None
    timings: list[RequestTiming] = []
    if cond != "off":
        target_port = port
        if cond == "down":
            target_port = free_port()  # nothing listens there
        elif cond == "slow":
            proxy = TcpProxy(port).start()
            proxy.delay(opts.delay_ms / 1e3)
            target_port = proxy.port
        d = Path(tempfile.mkdtemp(prefix=f"{cond}-", dir=workdir))
        tele = Telemetry(
            MqttConfig(host=host, port=target_port, device_id=f"bench-{cond}", reconnect_max_s=2),
            TelemetryConfig(interval_s=opts.interval_s, spool_path=d / "spool.sqlite", ledger_path=d / "ledger.sqlite"),
        ).start()
        observe = tele.llm_observer("bench", lm.ref.name)
    else:
        observe = None

    def on_finished(timing: RequestTiming) -> None:
        timings.append(timing)
        if observe is not None:
            observe(timing)

    scheduler = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0), on_finished=on_finished).start()
    params = SamplingParams(max_new_tokens=opts.max_new_tokens, ignore_eos=True)
    try:
        if tele is not None and cond == "up":
            tele.link.wait_connected(10)
        for prompt in prompts:
            scheduler.submit(prompt, params).result(600)
    finally:
        scheduler.stop()
        stats = None
        if tele is not None:
            tele.stop(timeout_s=1)  # seals and (when it can) publishes the last window
            stats = tele.stats()
        if proxy is not None:
            proxy.stop()
    ttft = [t.ttft_ms for t in timings if t.ttft_ms is not None]
    e2e = [t.e2e_ms for t in timings]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "requests": len(timings),
        "windows": stats["publisher"]["windows"] if stats else 0,
        "published": (stats["publisher"]["published_live"] + stats["publisher"]["published_historical"])
        if stats
        else 0,
        "spooled_at_end": stats["spool"]["records"] if stats else 0,
    }


def run(opts: TelemetryOptions) -> int:
    """Every condition in every round, medians and P99 ratios against 'off' printed (and written as JSON)."""
    from ..backends import SessionOptions
    from ..config import load_settings
    from ..models.catalog import resolve_model
    from ..models.llm import DecoderLM

    conditions = [c.strip() for c in opts.conditions.split(",") if c.strip()]
    bad = [c for c in conditions if c not in CONDITIONS]
    if bad or "off" not in conditions:
        raise InputError(
            f"--conditions must name some of {', '.join(CONDITIONS)} and include 'off'; got {opts.conditions!r}"
        )
    if opts.requests < 2 or opts.rounds < 1 or not opts.interval_s > 0:
        raise InputError("--requests must be >= 2, --rounds >= 1 and --interval-s > 0")
    settings = load_settings(opts.config)
    ref = resolve_model(opts.model, settings.models.cache_dir)
    lm = DecoderLM.open(ref, "onnxruntime", SessionOptions(device="cpu", threads=opts.threads))
    prompts = _prompts(lm, opts.requests, opts.prompt_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="edge-agent-bench-telemetry-"))
    broker = None
    try:
        if opts.broker:
            host, _, port_s = opts.broker.rpartition(":")
            host, port = host or "127.0.0.1", int(port_s)
        else:
            broker = _Mosquitto(opts.mosquitto, workdir)
            host, port = "127.0.0.1", broker.port
        _run_condition("off", lm, prompts[:2], opts, host, port, workdir)  # warm-up, not reported
        rounds: dict[str, list[dict]] = {c: [] for c in conditions}
        for r in range(opts.rounds):
            order = conditions[r % len(conditions) :] + conditions[: r % len(conditions)]
            for cond in order:
                res = _run_condition(cond, lm, prompts, opts, host, port, workdir)
                rounds[cond].append(res)
                if not opts.quiet:
                    print(
                        f"round {r + 1} {cond:<5} TTFT p50 {res['ttft_p50']:.1f} p99 {res['ttft_p99']:.1f} ms · "
                        f"E2E p50 {res['e2e_p50']:.1f} p99 {res['e2e_p99']:.1f} ms · windows {res['windows']}",
                        file=sys.stderr,
                    )
    finally:
        if broker is not None:
            broker.stop()
        lm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report = _report(rounds, opts)
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report))
    return 0


def _report(rounds: dict[str, list[dict]], opts: TelemetryOptions) -> dict[str, Any]:
    med = {
        c: {
            k: statistics.median(r[k] for r in rs)
            for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "windows", "published")
        }
        for c, rs in rounds.items()
    }
    off = med["off"]
    for m in med.values():
        m["ttft_p99_ratio"] = round(m["ttft_p99"] / off["ttft_p99"], 3) if off["ttft_p99"] else None
        m["e2e_p99_ratio"] = round(m["e2e_p99"] / off["e2e_p99"], 3) if off["e2e_p99"] else None
        m["e2e_p50_ratio"] = round(m["e2e_p50"] / off["e2e_p50"], 3) if off["e2e_p50"] else None
    return {
        "model": opts.model,
        "threads": opts.threads,
        "requests_per_condition": opts.requests,
        "rounds": opts.rounds,
        "interval_s": opts.interval_s,
        "delay_ms": opts.delay_ms,
        "prompt_tokens": opts.prompt_tokens,
        "max_new_tokens": opts.max_new_tokens,
        "median": med,
        "per_round": rounds,
    }


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"telemetry every {report['interval_s']} s · {report['requests_per_condition']} requests × "
        f"{report['rounds']} rounds · medians over rounds",
        f"{'condition':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} "
        f"{'p99 vs off':>10} {'windows':>8}",
    ]
    for c, m in report["median"].items():
        lines.append(
            f"{c:<10} {m['ttft_p50']:>9.1f} {m['ttft_p99']:>9.1f} {m['e2e_p50']:>9.1f} {m['e2e_p99']:>9.1f} "
            f"{m['e2e_p99_ratio']:>10.3f} {m['windows']:>8.0f}"
        )
    return "\n".join(lines)
