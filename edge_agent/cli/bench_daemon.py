"""``edge-agent bench telemetry``, ``bench fleet``, ``bench serve`` and ``bench overload``: the flags of the
workloads around the daemon (its telemetry, the fleet side, its HTTP API, the daemon under overload), parsed
into their options (``bench/options.py``) and handed to the workload's ``run``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from ..bench.options import CONDITIONS, FleetOptions, OverloadOptions, ServeOptions, TelemetryOptions, from_mapping


def add_telemetry(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "telemetry",
        help="inference latency with telemetry off / broker up / down / slow",
        description="Run LLM requests through the scheduler while telemetry publishes at a fast interval "
        "with the MQTT broker up, down and slow (delay proxy); compare P50/P99 with telemetry off.",
    )
    p.add_argument(
        "--model",
        default="demo-phi3-small",
        help="demo model name or model folder (default demo-phi3-small, 28.6 M parameters)",
    )
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--requests", type=int, default=24, help="requests per condition per round (default 24)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="rounds over all conditions; medians reported (default 3)")
    p.add_argument(
        "--interval-s", type=float, default=0.05, help="telemetry window interval (default 0.05: 20 windows/s)"
    )
    p.add_argument("--delay-ms", type=float, default=250.0, help="proxy delay for the slow broker (default 250)")
    p.add_argument("--broker", metavar="HOST:PORT", help="use this broker (default: start mosquitto on a free port)")
    p.add_argument("--mosquitto", default=None, help="mosquitto binary (default: from PATH or /usr/sbin)")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help="subset, comma-separated (default all)")
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--config", metavar="FILE", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_telemetry)
    return p


def _telemetry(args: argparse.Namespace) -> int:
    from ..bench import telemetry

    return telemetry.run(from_mapping(TelemetryOptions, vars(args)))


def add_fleet(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fleet",
        help="the fleet side (export, watch) at N simulated devices",
        description="Simulated devices publish through a local mosquitto; measure messages/s, "
        "fleet export and fleet watch lag and CPU per device count.",
    )
    p.add_argument("--devices", default="100,1000", help="device counts, comma-separated (default 100,1000)")
    p.add_argument("--interval-s", type=float, default=1.0, help="window interval per device (default 1)")
    p.add_argument("--duration-s", type=float, default=20.0, help="measured seconds per run (default 20)")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--scrape-every-s",
        type=float,
        default=10.0,
        help="scrape the exporter's /metrics this often, as Prometheus would (default 10)",
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--role", choices=("bench", "watch"), default="bench", help=argparse.SUPPRESS)
    p.add_argument("--broker", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_fleet)
    return p


def _fleet(args: argparse.Namespace) -> int:
    from ..bench import fleet

    if args.role == "watch":  # one process of a run: the fleet watch core, started by ``fleet.run`` itself
        return fleet.watch_role(args.broker, args.warmup_s, args.duration_s)
    return fleet.run(from_mapping(FleetOptions, vars(args)))


def _numbers(kind: type, name: str) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of positive ``kind`` numbers."""

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a comma-separated list of numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{name} values must be > 0, got {text!r}")
        return values

    return parse


def add_serve(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    p.set_defaults(func=_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    from ..bench import serve

    return serve.run(from_mapping(ServeOptions, vars(args)))


def _positive(kind: type, name: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text!r}")
        return value

    return parse


def add_overload(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # one flag per statement: the list reads best whole
    p = subparsers.add_parser(
        "overload",
        help="open-loop Poisson overload (0.5x-3x capacity) on the default tiers, llama.cpp's server beside it",
        description="Start a daemon on the default tiers, measure its capacity, then per round send seeded "
        "Poisson arrivals at 0.5x, 1x, 1.5x, 2x and 3x that capacity for --seconds each, spoken commands mixed "
        "in; the same arrivals against llama.cpp's server (4 slots) on the same GGUF. Prints goodput, admitted "
        "TTFT, refusals and voice turns per level; writes a markdown table, JSON and a PNG plot under --out.",
    )
    p.add_argument("--seconds", type=_positive(float, "--seconds"), default=30.0, help="per level (default 30)")
    p.add_argument("--rounds", type=_positive(int, "--rounds"), default=None,
                   help="rounds of all levels (default 3; with --resume: the earlier report's)")  # fmt: skip
    p.add_argument("--capacity", type=_positive(float, "--capacity"), default=None, metavar="PER_S",
                   help="chats/s the levels are multiples of (default: measured on the daemon first)")  # fmt: skip
    p.add_argument("--sla-ms", type=_positive(float, "--sla-ms"), default=387.0, help="goodput's TTFT bound")
    p.add_argument("--drain-s", type=_positive(float, "--drain-s"), default=90.0,
                   help="after a level, wait at most this long for its chats, then cancel them")  # fmt: skip
    p.add_argument("--seed", type=int, default=42, help="arrival schedules' seed (default 42)")
    p.add_argument("--out", type=Path, default=Path("overload"), metavar="DIR",
                   help="where overload.md, overload.json and overload.png go (default ./overload)")  # fmt: skip
    p.add_argument("--llama-server", default="llama-server", metavar="BIN",
                   help="llama.cpp's server binary (default: llama-server on PATH)")  # fmt: skip
    p.add_argument("--llamacpp-python", default=None, metavar="PY",
                   help="without llama-server: this Python's llama_cpp.server (one request at a time)")  # fmt: skip
    p.add_argument("--gguf", type=Path, default=None, help="its model (default: the GGUF the default model came from)")
    p.add_argument("--threads", type=_positive(int, "--threads"), default=os.cpu_count() or 1,
                   help="llama-server's threads (default: every core)")  # fmt: skip
    p.add_argument("--resume", type=Path, default=None, metavar="JSON",
                   help="keep the systems of this earlier overload.json, run the others on its schedule")  # fmt: skip
    p.add_argument("--no-llamacpp", action="store_true", help="the daemon only")
    p.add_argument("--no-speech", action="store_true", help="chats only")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_overload)
    return p


def _overload(args: argparse.Namespace) -> int:
    from ..bench import overload

    return overload.run(from_mapping(OverloadOptions, vars(args)))
