"""The workloads that return a report (``edge-agent bench prefill``, ``prefix-cache``, ``prefix-soak``,
``weight-only``) refuse options out of range before they load anything, whether the command line or code
built the options (``bench/options.py``); and a report records its options as JSON."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from edge_agent.bench import options as o
from edge_agent.errors import InputError

# module, its entry point, options out of range and the message that names them
OUT_OF_RANGE = [
    ("prefill", "run", o.PrefillOptions(chunk=0), "--chunk"),
    ("prefill", "run", o.PrefillOptions(streams=0), "--streams"),
    ("prefix_cache", "run", o.PrefixCacheOptions(rounds=0), "--rounds"),
    ("prefix_cache", "run", o.PrefixCacheOptions(system_tokens=0), "--system-tokens"),
    ("prefix_soak", "soak", o.PrefixSoakOptions(every=0), "counts must be at least 1"),
    ("prefix_soak", "soak", o.PrefixSoakOptions(max_mb=0.0), "--max-mb above 0"),
    ("weight_only", "run", o.WeightOnlyOptions(tokens=0), "--tokens"),
    ("weight_only", "run", o.WeightOnlyOptions(engines={"int4": Path("x")}, backend="openvino"), "--backend"),
]


@pytest.mark.parametrize(("name", "entry", "opts", "message"), OUT_OF_RANGE)
def test_options_out_of_range_are_refused_before_a_model_is_loaded(
    name: str, entry: str, opts: object, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"edge_agent.bench.{name}")
    monkeypatch.setattr(module, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(InputError, match=message):
        getattr(module, entry)(opts)


def test_weight_only_refuses_an_engine_folder_without_a_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent.bench import weight_only

    monkeypatch.setattr(weight_only, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(InputError, match=r"int4=.*: no model\.onnx there"):
        weight_only.run(o.WeightOnlyOptions(engines={"int4": tmp_path}))


def test_as_json_writes_paths_as_text(tmp_path) -> None:
    opts = o.PrefillOptions(cache_dir=tmp_path, genai=None)
    got = o.as_json(opts)
    assert got["cache_dir"] == str(tmp_path) and got["genai"] is None and got["streams"] == opts.streams
