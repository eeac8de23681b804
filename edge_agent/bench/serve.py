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

import argparse
import asyncio
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
from .serve_client import Load, RequestResult, Target, chat_stream, get_text, make_prompt
from .serve_report import against_c1, client_figures, format_level, plot_levels, ratios

SEED = 1234


def _numbers(kind: type, name: str):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a comma-separated list of numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{name} values must be > 0, got {text!r}")
        return values

    return parse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="drive a running daemon over HTTP; client-side latency next to the daemon's own",
        description="Send streamed chat completions to a running `edge-agent run` (closed loop, Poisson "
        "arrivals, or one at a time with idle gaps) and print, per load level, TTFT/ITL/E2E as the "
        "client saw them next to the daemon's /metrics figures for the same requests, with ratios.",
    )
    p.add_argument("--url", default=None, help="the daemon's API (default: from the config, http://127.0.0.1:8080)")
    p.add_argument("--unix-socket", default=None, metavar="PATH", help="talk to the API over this unix socket")
    p.add_argument("--token", default=None, help="bearer token (default: $EDGE_AGENT_API_TOKEN, else api.token)")
    p.add_argument("--config", metavar="FILE", default=None, help="the daemon's config (for URL, token and SLA)")
    p.add_argument("--mode", choices=("closed", "poisson", "sequential"), default=None, help="default closed")
    p.add_argument(
        "--concurrency", type=_numbers(int, "--concurrency"), default=[1], metavar="C[,C…]", help="closed loop"
    )
    p.add_argument("--rate", type=_numbers(float, "--rate"), default=None, metavar="R[,R…]", help="Poisson req/s")
    p.add_argument(
        "--sequential-gap-s", type=float, default=None, metavar="S", help="one request at a time, S s idle between"
    )
    p.add_argument("--requests", type=int, default=None, metavar="N", help="requests per level (default 16)")
    p.add_argument("--duration-s", type=float, default=None, metavar="S", help="send requests for S s per level")
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="P", help="prompt of about P words")
    p.add_argument("--max-tokens", type=int, default=64, metavar="T", help="max_tokens per request (default 64)")
    p.add_argument("--temperature", type=float, default=None, help="sent when given (default: the API's)")
    p.add_argument("--model", default=None, help="the request's model field (default: none, the active tier)")
    p.add_argument("--sla-ms", type=float, default=None, help="goodput counts TTFT <= this (default sla.target_ms)")
    p.add_argument(
        "--ramp-s",
        type=float,
        default=None,
        metavar="S",
        help="closed loop: client k starts at k·S/C (default: the warm-up request's e2e, so equal requests "
        "do not arrive in lockstep; 0 = all at once)",
    )
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="requests sent first and left out (default 1)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request (default 600)")
    p.add_argument("--mqtt", default=None, metavar="HOST:PORT", help="also read the daemon's tele/latency windows")
    p.add_argument("--device-id", default=None, help="the daemon's device id for --mqtt (default from config)")
    p.add_argument(
        "--json", dest="json_out", nargs="?", const="-", default=None, metavar="OUT", help="JSON to OUT (or stdout)"
    )
    p.add_argument("--plot", metavar="PNG", default=None, help="TTFT/ITL percentiles per level, client vs daemon")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)
    return p


def _validate(args: argparse.Namespace) -> None:
    if args.mode is None:
        args.mode = "sequential" if args.sequential_gap_s is not None else "poisson" if args.rate else "closed"
    if args.mode == "poisson" and not args.rate:
        raise InputError("--mode poisson needs --rate R (requests/s)")
    if args.mode == "sequential" and args.sequential_gap_s is None:
        args.sequential_gap_s = 1.0
    if args.sequential_gap_s is not None and args.sequential_gap_s < 0:
        raise InputError(f"--sequential-gap-s must be >= 0, got {args.sequential_gap_s}")
    if args.requests is None and args.duration_s is None:
        args.requests = 16
    for name in ("requests", "prompt_tokens", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("duration_s", "timeout_s", "sla_ms"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.warmup < 0:
        raise InputError(f"--warmup must be >= 0, got {args.warmup}")


def _settings(args: argparse.Namespace):
    """The daemon's settings when a config is given or installed; None otherwise (a client needs none)."""
    from ..config import load_settings, resolve_config_path

    if args.config is None and resolve_config_path(None) is None:
        return None
    return load_settings(args.config)


def _target(args: argparse.Namespace, settings) -> Target:
    api = settings.api if settings is not None else None
    unix_socket = args.unix_socket or (str(api.unix_socket) if api is not None and api.unix_socket else None)
    if args.url:
        base = args.url.rstrip("/")
        if urlsplit(base).scheme not in ("http", "https"):
            raise InputError(f"--url must start with http:// or https://, got {args.url!r}")
    elif unix_socket:
        base = "http://localhost"
    else:
        host = api.host if api is not None else "127.0.0.1"
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        base = f"http://{'[' + host + ']' if ':' in host else host}:{api.port if api is not None else 8080}"
    token = args.token or os.environ.get("EDGE_AGENT_API_TOKEN")
    if token is None and api is not None and api.token is not None:
        token = api.token.get_secret_value()
    return Target(base, token, unix_socket, args.timeout_s)


def _levels(args: argparse.Namespace) -> list[dict]:
    if args.mode == "sequential":
        return [{"mode": "sequential", "gap_s": args.sequential_gap_s, "label": f"seq gap {args.sequential_gap_s:g}s"}]
    if args.mode == "poisson":
        return [{"mode": "poisson", "rate": r, "label": f"rate {r:g}/s"} for r in args.rate]
    return [{"mode": "closed", "concurrency": c, "label": f"C={c}"} for c in args.concurrency]


def run(args: argparse.Namespace) -> int:
    _validate(args)
    settings = _settings(args)
    target = _target(args, settings)
    if args.sla_ms is None:
        args.sla_ms = settings.sla.target_ms if settings is not None else 387.0
    windows = None
    if args.mqtt:
        host, _, port = args.mqtt.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"--mqtt takes HOST:PORT, got {args.mqtt!r}")
        device = args.device_id or (settings.mqtt.device_id if settings is not None else None)
        if not device:
            raise InputError("--mqtt needs --device-id (or a config that names mqtt.device_id)")
        prefix = settings.mqtt.topic_prefix if settings is not None else "edge/v1"
        interval_s = settings.telemetry.interval_s if settings is not None else 10.0
        windows = sd.LatencyWindows(host, int(port), f"{prefix}/{device}/tele/latency", wait_s=interval_s + 5.0)
    try:
        report = asyncio.run(_run(args, target, windows, settings))
    finally:
        if windows is not None:
            windows.close()
    text = "\n\n".join([report["header"], *(format_level(lv) for lv in report["levels"])])
    if args.json_out == "-":
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(text)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_levels(report, Path(args.plot))
    return 0


def _body(args: argparse.Namespace):
    def body(index: int) -> dict:
        b: dict = {
            "messages": [{"role": "user", "content": make_prompt(args.prompt_tokens, index, SEED)}],
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.temperature is not None:
            b["temperature"] = args.temperature
        if args.model:
            b["model"] = args.model
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


async def _run(args: argparse.Namespace, target: Target, windows, settings) -> dict:
    body = _body(args)
    show = not args.quiet
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
        for k in range(args.warmup):
            warm = await chat_stream(session, target, body(-1 - k))
            if not warm.ok:
                raise InputError(f"the warm-up request failed: {warm.status} {warm.error}")
            warm_e2e_s = (warm.e2e_ms or 0.0) / 1e3
        ramp_s = args.ramp_s if args.ramp_s is not None else warm_e2e_s
        levels = []
        for level in _levels(args):
            levels.append(await _level(args, session, target, body, level, windows, show, ramp_s))
        against_c1(levels)
        health = await _idle(session, target)
    llm = health.get("llm") or {}
    load = " or ".join(
        x
        for x in (
            f"{args.requests} requests" if args.requests is not None else "",
            f"{args.duration_s:g} s" if args.duration_s is not None else "",
        )
        if x
    )
    header = (
        f"bench serve: {target.unix_socket or target.base_url}, tier {llm.get('tier')} ({llm.get('model')}); "
        f"{load} per level, prompt ~{args.prompt_tokens} words, max_tokens {args.max_tokens}; "
        f"goodput at TTFT <= {args.sla_ms:g} ms; daemon figures from /metrics (bucket estimates)"
    )
    return {
        "header": header,
        "url": target.base_url,
        "unix_socket": target.unix_socket,
        "tier": llm.get("tier"),
        "model": llm.get("model"),
        "mode": args.mode,
        "requests_per_level": args.requests,
        "duration_s_per_level": args.duration_s,
        "prompt_words": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "sla_ms": args.sla_ms,
        "warmup": args.warmup,
        "levels": levels,
    }


async def _level(args, session, target: Target, body, level: dict, windows, show: bool, ramp_s: float) -> dict:
    await _idle(session, target)
    before = await _scrape(session, target)
    total = args.requests
    with Progress(level["label"], "req", enabled=show) as prog:
        load = Load(session, target, body, args.requests, args.duration_s, lambda n: prog.update(n, total))
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
    client = client_figures(results, wall, args.sla_ms)
    out = {**level, "client": client, "daemon": daemon, "client_over_daemon": ratios(client, daemon)}
    if windows is not None:
        out["mqtt"] = await asyncio.to_thread(windows.figures, start_wall, end_wall)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edge-agent bench")
    add_parser(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
