"""``edge-agent bench``'s flags and the workloads' options (``bench/options.py``): a command with no flags
measures what the options' defaults measure, every flag reaches an option of the same name, and the
handler passes the parsed values through unchanged."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from edge_agent.bench import options as o
from edge_agent.cli import build_parser

# The workloads whose flags are parsed into an options dataclass; flags that only the command line has
# (argparse's own and the top-level ones) are left out of the comparison.
WORKLOADS = {
    "llm": o.LLMOptions,
    "tiers": o.TiersOptions,
    "grammar": o.GrammarOptions,
}
# The function each command calls: (module in edge_agent.bench, name)
ENTRY_POINTS = {"llm": ("llm", "run"), "tiers": ("tiers", "run"), "grammar": ("grammar", "main")}
CLI_ONLY = {"command", "bench_command", "func", "debug", "log_format", "log_level"}


def _parsed(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(["bench", *argv]))
    return {k: v for k, v in args.items() if k not in CLI_ONLY}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_no_flags_parse_to_the_options_defaults(workload: str) -> None:
    cls = WORKLOADS[workload]
    defaults = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    assert _parsed([workload]) == defaults


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_command_hands_the_parsed_options_to_the_workload(workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler calls the workload's entry point once with options holding exactly what was parsed."""
    module_name, entry = ENTRY_POINTS[workload]
    module = importlib.import_module(f"edge_agent.bench.{module_name}")
    calls: list[object] = []
    monkeypatch.setattr(module, entry, lambda opts: calls.append(opts) or 0)
    args = build_parser().parse_args(["bench", workload, "--quiet"])
    assert args.func(args) == 0
    assert len(calls) == 1 and isinstance(calls[0], WORKLOADS[workload])
    assert dataclasses.asdict(calls[0]) == _parsed([workload, "--quiet"])


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
