"""The benchmarks run as ``python -m edge_agent.bench.<name>``: with no flags, each hands its workload the
options' defaults (``bench/options.py``), so code calling the workload measures what the command does."""

from __future__ import annotations

import importlib

import pytest

from edge_agent.bench import options as o

# module, the workload function its main calls, and the options it takes
MAINS = {
    "prefill": ("run", o.PrefillOptions),
    "prefix_cache": ("run", o.PrefixCacheOptions),
    "prefix_soak": ("soak", o.PrefixSoakOptions),
    "inplace_kv": ("run", o.InplaceKvOptions),
}


class _Stop(Exception):
    """Raised by the stand-in workload: what main parsed is all the test needs."""


def _parsed(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The options ``main(argv)`` of module ``name`` hands its workload (which is stopped there)."""
    entry, _ = MAINS[name]
    module = importlib.import_module(f"edge_agent.bench.{name}")
    got: list[object] = []

    def workload(opts: object, *_: object, **__: object) -> dict:
        got.append(opts)
        raise _Stop

    monkeypatch.setattr(module, entry, workload)
    with pytest.raises(_Stop):
        module.main(argv)
    return got


@pytest.mark.parametrize("name", sorted(MAINS))
def test_main_without_flags_runs_the_options_defaults(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parsed(name, [], monkeypatch) == [MAINS[name][1]()]


@pytest.mark.parametrize("name", sorted(MAINS))
def test_a_flag_reaches_its_option(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parsed(name, ["--threads", "7"], monkeypatch) == [MAINS[name][1](threads=7)]


def test_as_json_writes_paths_as_text(tmp_path) -> None:
    opts = o.PrefillOptions(cache_dir=tmp_path, genai=None)
    got = o.as_json(opts)
    assert got["cache_dir"] == str(tmp_path) and got["genai"] is None and got["streams"] == opts.streams
