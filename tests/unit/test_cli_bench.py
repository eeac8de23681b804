"""``edge-agent bench``'s flags and the workloads' options (``bench/options.py``): a command with no flags
measures what the options' defaults measure, every flag reaches an option of the same name, and the
handler passes the parsed values through unchanged; a workload that returns a report has it printed and,
with ``--json OUT``, written to OUT."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

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
    "prefill": (o.PrefillOptions, "prefill", "run", ["--genai", "g", "--streams", "2", "--chunk", "32"]),
    "prefix-cache": (o.PrefixCacheOptions, "prefix_cache", "run", ["--inplace", "--max-mb", "8", "--threads", "1"]),
    "prefix-soak": (o.PrefixSoakOptions, "prefix_soak", "soak", ["--requests", "10", "--every", "5"]),
    "inplace-kv": (o.InplaceKvOptions, "inplace_kv", "run", ["--genai", "none", "--prompt-tokens", "8"]),
    "weight-only": (
        o.WeightOnlyOptions,
        "weight_only",
        "run",
        ["--engine", "int4=e4", "--engine", "x=~/e", "--rounds", "2"],
    ),
}
# The workloads whose entry returns a report, and the function that formats it; the command prints that and
# writes the report itself with --json OUT (the figures only, for inplace-kv).
REPORTS = {
    "prefill": "format_report",
    "prefix-cache": "format_report",
    "prefix-soak": "format_report",
    "inplace-kv": "format_report",
    "weight-only": "render",
}
# Flags that only the command line has: argparse's own, the top-level ones, and fleet's hidden watch role;
# --json OUT of a workload that returns its report.
CLI_ONLY = {"command", "bench_command", "func", "debug", "log_format", "log_level"}
WATCH_ROLE = {"role", "broker"}


def _parsed(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(["bench", *argv]))
    cli_only = (
        CLI_ONLY | (WATCH_ROLE if argv[0] == "fleet" else set()) | ({"json_out"} if argv[0] in REPORTS else set())
    )
    return {k: v for k, v in args.items() if k not in cli_only}


def _stub_report(monkeypatch: pytest.MonkeyPatch, workload: str, module: object, report: object) -> list[object]:
    """Stand the workload's entry in with one that records its options and returns ``report``; a report's
    formatter says which report it got. The options handed over are returned (a list, filled when called)."""
    _, _, entry, _ = WORKLOADS[workload]
    calls: list[object] = []
    monkeypatch.setattr(module, entry, lambda opts, *_, **__: calls.append(opts) or report)
    if workload in REPORTS:
        monkeypatch.setattr(module, REPORTS[workload], lambda got, *_: f"table of {got['model']}")
    return calls


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_no_flags_parse_to_the_options_defaults(workload: str) -> None:
    cls = WORKLOADS[workload][0]
    defaults = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    assert _parsed([workload]) == defaults


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_command_hands_the_parsed_options_to_the_workload(workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler calls the workload's entry point once with options holding exactly what was parsed."""
    cls, module_name, _, argv = WORKLOADS[workload]
    module = importlib.import_module(f"edge_agent.bench.{module_name}")
    calls = _stub_report(monkeypatch, workload, module, {"model": "m"} if workload in REPORTS else 0)
    args = build_parser().parse_args(["bench", workload, *argv])
    assert args.func(args) == 0
    assert len(calls) == 1 and isinstance(calls[0], cls)
    got = dataclasses.asdict(calls[0])
    assert got == _parsed([workload, *argv]) and got != dataclasses.asdict(cls())


@pytest.mark.parametrize("workload", sorted(REPORTS))
def test_the_report_is_printed_and_written_to_the_json_file(
    workload: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"edge_agent.bench.{WORKLOADS[workload][1]}")
    report = {"model": "m", "median_tok_s": {"plain": 1.5}, "rounds": {"plain": [1.5]}, "skipped": {}, "extra": [1]}
    calls = _stub_report(monkeypatch, workload, module, report)
    out = tmp_path / "report.json"
    args = build_parser().parse_args(["bench", workload, "--json", str(out)])
    assert args.func(args) == 0 and len(calls) == 1
    assert capsys.readouterr().out == "table of m\n"
    expected = {k: report[k] for k in ("median_tok_s", "rounds", "skipped")} if workload == "inplace-kv" else report
    assert json.loads(out.read_text()) == expected


def test_weight_only_engines_are_labelled_folders() -> None:
    argv = ["bench", "weight-only", "--engine", "int4=a/int4", "--engine", "int8w=~/b", "--engine", "int4=c"]
    args = build_parser().parse_args(argv)
    assert args.engines == {"int4": Path("c"), "int8w": Path("~/b").expanduser()}  # a later label wins


@pytest.mark.parametrize("bad", ["int4", "=folder", "int4="])
def test_weight_only_refuses_an_engine_without_label_and_folder(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "weight-only", "--engine", bad])
    assert exc.value.code == 2 and "LABEL=FOLDER" in capsys.readouterr().err


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
