"""``edge-agent bench serve``: drive a running daemon (``edge-agent run``) over HTTP with streamed
OpenAI chat requests and put what the clients saw next to what the daemon reported for the same
requests.

Per load level (a concurrency of a closed loop, a Poisson rate, or requests one at a time with idle
gaps) it scrapes ``/metrics`` before and after, so the daemon's figures cover exactly that level's
requests (provided nothing else talks to the daemon meanwhile). ``client / daemon`` ratios show what
lies between the app and the scheduler: HTTP, JSON, tokenizing the prompt, queueing in the API.
The client's percentiles are exact nearest-rank; the daemon's are read from its Prometheus buckets
(``serve_daemon.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from ..errors import InputError
from ..progress import Progress
from . import serve_daemon as sd
from .options import ServeOptions
from .serve_client import Load, RequestResult, Target, chat_stream, get_text, make_prompt
from .serve_report import against_c1, client_figures, format_level, plot_levels, ratios

SEED = 1234


def _validate(opts: ServeOptions) -> ServeOptions:
    """A copy of ``opts`` with the mode, the sequential gap and the request count filled in; checked."""
    mode = opts.mode or ("sequential" if opts.sequential_gap_s is not None else "poisson" if opts.rate else "closed")
    opts = dataclasses.replace(opts, mode=mode)
    if opts.mode == "poisson" and not opts.rate:
        raise InputError("--mode poisson needs --rate R (requests/s)")
    if opts.mode == "sequential" and opts.sequential_gap_s is None:
        opts = dataclasses.replace(opts, sequential_gap_s=1.0)
    if opts.sequential_gap_s is not None and opts.sequential_gap_s < 0:
        raise InputError(f"--sequential-gap-s must be >= 0, got {opts.sequential_gap_s}")
    if opts.requests is None and opts.duration_s is None:
        opts = dataclasses.replace(opts, requests=16)
    for name in ("requests", "prompt_tokens", "max_tokens"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("duration_s", "timeout_s", "sla_ms"):
        value = getattr(opts, name)
        if value is not None and not value > 0:
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if opts.warmup < 0:
        raise InputError(f"--warmup must be >= 0, got {opts.warmup}")
    return opts


def _settings(opts: ServeOptions):
    """The daemon's settings when a config is given or installed; None otherwise (a client needs none)."""
    from ..config import load_settings, resolve_config_path

    if opts.config is None and resolve_config_path(None) is None:
        return None
    return load_settings(opts.config)


def _target(opts: ServeOptions, settings) -> Target:
    api = settings.api if settings is not None else None
    unix_socket = opts.unix_socket or (str(api.unix_socket) if api is not None and api.unix_socket else None)
    if opts.url:
        base = opts.url.rstrip("/")
        if urlsplit(base).scheme not in ("http", "https"):
            raise InputError(f"--url must start with http:// or https://, got {opts.url!r}")
    elif unix_socket:
        base = "http://localhost"
    else:
        host = api.host if api is not None else "127.0.0.1"
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        base = f"http://{'[' + host + ']' if ':' in host else host}:{api.port if api is not None else 8080}"
    token = opts.token or os.environ.get("EDGE_AGENT_API_TOKEN")
    if token is None and api is not None and api.token is not None:
        token = api.token.get_secret_value()
    return Target(base, token, unix_socket, opts.timeout_s)


def _levels(opts: ServeOptions) -> list[dict]:
    if opts.mode == "sequential":
        return [{"mode": "sequential", "gap_s": opts.sequential_gap_s, "label": f"seq gap {opts.sequential_gap_s:g}s"}]
    if opts.mode == "poisson":
        return [{"mode": "poisson", "rate": r, "label": f"rate {r:g}/s"} for r in opts.rate or ()]
    return [{"mode": "closed", "concurrency": c, "label": f"C={c}"} for c in opts.concurrency]


def run(opts: ServeOptions) -> int:
    """Every load level against the daemon ``opts`` names; the levels printed (and written as JSON, drawn)."""
    opts = _validate(opts)
    settings = _settings(opts)
    target = _target(opts, settings)
    if opts.sla_ms is None:
        opts = dataclasses.replace(opts, sla_ms=settings.sla.target_ms if settings is not None else 387.0)
    windows = None
    if opts.mqtt:
        host, _, port = opts.mqtt.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"--mqtt takes HOST:PORT, got {opts.mqtt!r}")
        device = opts.device_id or (settings.mqtt.device_id if settings is not None else None)
        if not device:
            raise InputError("--mqtt needs --device-id (or a config that names mqtt.device_id)")
        prefix = settings.mqtt.topic_prefix if settings is not None else "edge/v1"
        interval_s = settings.telemetry.interval_s if settings is not None else 10.0
        windows = sd.LatencyWindows(host, int(port), f"{prefix}/{device}/tele/latency", wait_s=interval_s + 5.0)
    try:
        report = asyncio.run(_run(opts, target, windows, settings))
    finally:
        if windows is not None:
            windows.close()
    text = "\n\n".join([report["header"], *(format_level(lv) for lv in report["levels"])])
    if opts.json_out == "-":
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(text)
        if opts.json_out:
            Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if opts.plot:
        plot_levels(report, Path(opts.plot))
    return 0


def _body(opts: ServeOptions):
    def body(index: int) -> dict:
        b: dict = {
            "messages": [{"role": "user", "content": make_prompt(opts.prompt_tokens, index, SEED)}],
            "max_tokens": opts.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if opts.temperature is not None:
            b["temperature"] = opts.temperature
        if opts.model:
            b["model"] = opts.model
        return b

    return body


async def _scrape(session: aiohttp.ClientSession, target: Target) -> dict:
    status, text = await get_text(session, target, "/metrics")
    if status != 200:
        raise InputError(f"{target.base_url}/metrics answered {status}: {text[:200]}")
    return sd.parse_metrics(text)


async def _idle(session: aiohttp.ClientSession, target: Target, timeout_s: float = 30.0) -> dict:
    """/health once the LLM has nothing waiting or running (left-overs of a previous level)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, text = await get_text(session, target, "/health")
        health = json.loads(text) if status == 200 else {}
        llm = health.get("llm") or {}
        if status == 200 and not llm.get("waiting") and not llm.get("running"):
            return health
        if time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.05)


async def _run(opts: ServeOptions, target: Target, windows, settings) -> dict:
    body = _body(opts)
    show = not opts.quiet
    async with target.session() as session:
        try:
            status, text = await get_text(session, target, "/health")
        except aiohttp.ClientError as exc:
            where = target.unix_socket or target.base_url
            raise InputError(f"cannot reach the daemon at {where}: {exc} (is `edge-agent run` running?)") from exc
        if status == 401:
            raise InputError(f"{target.base_url} wants a bearer token: give --token or set EDGE_AGENT_API_TOKEN")
        health = json.loads(text) if text.startswith("{") else {}
        if not health.get("llm"):
            raise InputError(f"{target.base_url}/health reports no LLM served (status {status}): {text[:200]}")
        await _scrape(session, target)  # /metrics reachable (and authorized) before any load
        warm_e2e_s = 0.0
        for k in range(opts.warmup):
            warm = await chat_stream(session, target, body(-1 - k))
            if not warm.ok:
                raise InputError(f"the warm-up request failed: {warm.status} {warm.error}")
            warm_e2e_s = (warm.e2e_ms or 0.0) / 1e3
        ramp_s = opts.ramp_s if opts.ramp_s is not None else warm_e2e_s
        levels = []
        for level in _levels(opts):
            levels.append(await _level(opts, session, target, body, level, windows, show, ramp_s))
        against_c1(levels)
        health = await _idle(session, target)
    llm = health.get("llm") or {}
    load = " or ".join(
        x
        for x in (
            f"{opts.requests} requests" if opts.requests is not None else "",
            f"{opts.duration_s:g} s" if opts.duration_s is not None else "",
        )
        if x
    )
    header = (
        f"bench serve: {target.unix_socket or target.base_url}, tier {llm.get('tier')} ({llm.get('model')}); "
        f"{load} per level, prompt ~{opts.prompt_tokens} words, max_tokens {opts.max_tokens}; "
        f"goodput at TTFT <= {opts.sla_ms:g} ms; daemon figures from /metrics (bucket estimates)"
    )
    return {
        "header": header,
        "url": target.base_url,
        "unix_socket": target.unix_socket,
        "tier": llm.get("tier"),
        "model": llm.get("model"),
        "mode": opts.mode,
        "requests_per_level": opts.requests,
        "duration_s_per_level": opts.duration_s,
        "prompt_words": opts.prompt_tokens,
        "max_tokens": opts.max_tokens,
        "sla_ms": opts.sla_ms,
        "warmup": opts.warmup,
        "levels": levels,
    }


async def _level(
    opts: ServeOptions, session, target: Target, body, level: dict, windows, show: bool, ramp_s: float
) -> dict:
    await _idle(session, target)
    before = await _scrape(session, target)
    total = opts.requests
    with Progress(level["label"], "req", enabled=show) as prog:
        load = Load(session, target, body, opts.requests, opts.duration_s, lambda n: prog.update(n, total))
        start_wall = time.time()
        if level["mode"] == "closed":
            level["ramp_s"] = ramp_s if level["concurrency"] > 1 else 0.0
            wall = await load.closed(level["concurrency"], level["ramp_s"])
        elif level["mode"] == "poisson":
            wall = await load.poisson(level["rate"], SEED)
        else:
            wall = await load.sequential(level["gap_s"])
        end_wall = time.time()
    results: list[RequestResult] = load.results
    ok = sum(1 for r in results if r.ok)
    # The daemon counts a request on its device thread as it finishes, which can trail the last chunk.
    deadline = time.monotonic() + 3.0
    while True:
        delta = sd.diff(before, await _scrape(session, target))
        daemon = sd.daemon_figures(delta)
        if daemon["requests"] >= ok or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    if opts.sla_ms is None:  # ``run`` fills it in from the config before any level
        raise ValueError("bench serve levels need sla_ms")
    client = client_figures(results, wall, opts.sla_ms)
    out = {**level, "client": client, "daemon": daemon, "client_over_daemon": ratios(client, daemon)}
    if windows is not None:
        out["mqtt"] = await asyncio.to_thread(windows.figures, start_wall, end_wall)
    return out
