"""``edge-agent bench``'s flags and the workloads' options (``bench/options.py``): a command with no flags
measures what the options' defaults measure, every flag reaches an option of the same name, and the
handler passes the parsed values through unchanged."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from edge_agent.bench import options as o
from edge_agent.cli import build_parser

# The workloads whose flags are parsed into an options dataclass: the dataclass, the function the command calls
# (module in edge_agent.bench, name) and a few flags away from the defaults.
WORKLOADS = {
    "llm": (o.LLMOptions, "llm", "run", ["--quiet", "--requests", "4", "--ov-genai", "none"]),
    "tiers": (o.TiersOptions, "tiers", "run", ["--workload", "asr", "--quiet"]),
    "grammar": (o.GrammarOptions, "grammar", "main", ["--tokenizer", "t.json", "--json"]),
    "asr": (o.AsrOptions, "asr", "run", ["--streams", "1,4", "--compare", "--audio", "a.wav", "--audio", "b.wav"]),
    "telemetry": (o.TelemetryOptions, "telemetry", "run", ["--conditions", "off,up", "--delay-ms", "10"]),
    "fleet": (o.FleetOptions, "fleet", "run", ["--devices", "10", "--json", "f.json"]),
    "serve": (o.ServeOptions, "serve", "run", ["--rate", "2,4.5", "--json"]),
    "voice": (o.VoiceOptions, "voice", "run", ["--utterances", "2", "--tools", "t.json", "--quiet"]),
    "calls": (o.CallsOptions, "calls", "run", ["--speech", "--context", "both", "--threads", "2"]),
    "overload": (o.OverloadOptions, "overload", "run", ["--seconds", "10", "--no-llamacpp", "--resume", "r.json"]),
}
# Flags that only the command line has: argparse's own, the top-level ones, and fleet's hidden watch role.
CLI_ONLY = {"command", "bench_command", "func", "debug", "log_format", "log_level"}
WATCH_ROLE = {"role", "broker"}


def _parsed(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(["bench", *argv]))
    cli_only = CLI_ONLY | (WATCH_ROLE if argv[0] == "fleet" else set())
    return {k: v for k, v in args.items() if k not in cli_only}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_no_flags_parse_to_the_options_defaults(workload: str) -> None:
    cls = WORKLOADS[workload][0]
    defaults = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    assert _parsed([workload]) == defaults


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_command_hands_the_parsed_options_to_the_workload(workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler calls the workload's entry point once with options holding exactly what was parsed."""
    cls, module_name, entry, argv = WORKLOADS[workload]
    module = importlib.import_module(f"edge_agent.bench.{module_name}")
    calls: list[object] = []
    monkeypatch.setattr(module, entry, lambda opts: calls.append(opts) or 0)
    args = build_parser().parse_args(["bench", workload, *argv])
    assert args.func(args) == 0
    assert len(calls) == 1 and isinstance(calls[0], cls)
    got = dataclasses.asdict(calls[0])
    assert got == _parsed([workload, *argv]) and got != dataclasses.asdict(cls())


def test_fleet_watch_role_runs_the_watch_core_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench fleet --role watch`` (the process ``fleet.run`` starts) runs the watch core, not a whole run."""
    from edge_agent.bench import fleet

    watched: list[tuple] = []
    monkeypatch.setattr(fleet, "watch_role", lambda *a: watched.append(a) or 0)
    monkeypatch.setattr(fleet, "run", lambda opts: pytest.fail("a whole run started"))
    argv = ["bench", "fleet", "--role", "watch", "--broker", "127.0.0.1:1883", "--warmup-s", "2", "--duration-s", "3"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    assert watched == [("127.0.0.1:1883", 2.0, 3.0)]


def test_from_mapping_ignores_what_is_not_a_field() -> None:
    got = o.from_mapping(o.LLMOptions, {"requests": 4, "func": print, "bench_command": "llm"})
    assert got == o.LLMOptions(requests=4)


def test_flags_land_on_the_option_of_the_same_name() -> None:
    args = build_parser().parse_args(
        ["bench", "llm", "--requests", "4", "--json", "r.json", "--ov-genai", "none", "--no-baseline"]
    )
    opts = o.from_mapping(o.LLMOptions, vars(args))
    assert (opts.requests, opts.json_out, opts.ov_genai, opts.no_baseline) == (4, "r.json", "none", True)
    assert opts.concurrency == o.LLMOptions().concurrency


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.LLMOptions().sla_ms = 1.0  # type: ignore[misc]
