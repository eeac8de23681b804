"""A cancelled build (the agent stopping) stops at its next step or sample, commits nothing, keeps
only finished steps staged, and the next build resumes from them. Real ONNX Runtime builds of the
tiny ``demo-phi3`` into a temporary engine cache."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edge_agent.engines.cache import EngineCache
from edge_agent.engines.pipeline import BuildCancelled, BuildRequest, Heartbeat, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.systemd import Notifier

pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[2]

RECIPE = f"""
name = "tiny-phi3"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "fp16"]
[heldout]
data = "{ROOT}/calibration/llm/heldout.jsonl"
samples = 4
[accuracy]
min_cosine = 0.5
min_top1 = 0.1
max_kl = 5.0
"""


class CancelAfter:
    """A heartbeat clock that sets ``cancel`` on its ``n``-th tick: the build is cancelled mid-step."""

    def __init__(self, cancel: threading.Event, n: int) -> None:
        self.cancel, self.n, self.ticks = cancel, n, 0

    def __call__(self) -> float:
        self.ticks += 1
        if self.ticks == self.n:
            self.cancel.set()
        return 0.0


def pipeline(tmp_path: Path, heartbeat: Heartbeat) -> tuple[Pipeline, EngineCache]:
    (tmp_path / "tiny-phi3.toml").write_text(RECIPE)
    cache = EngineCache(tmp_path / "engines", 1 << 30)
    return Pipeline(load_recipe(tmp_path / "tiny-phi3.toml"), cache, tmp_path / "models", 1, heartbeat), cache


def test_a_cancel_mid_step_commits_nothing_and_the_next_build_resumes(tmp_path):
    cancel = threading.Event()
    clock = CancelAfter(cancel, 3)  # tick 1: the reference step starts; 2, 3: its samples
    pipe, cache = pipeline(tmp_path, Heartbeat(enabled=False, notifier=Notifier({}), clock=clock, cancel=cancel))
    with pytest.raises(BuildCancelled):
        pipe.build(BuildRequest("cpu", "fp16"))
    assert cache.entries() == []
    assert not (cache.entries_dir.exists() and any(cache.entries_dir.iterdir()))
    staged = [p for p in cache.staging_dir.iterdir() if p.is_dir()]
    assert len(staged) == 1
    assert not (staged[0] / "steps").exists() or not any((staged[0] / "steps").iterdir())  # no step finished
    assert not [p for p in cache.root.rglob("*") if p.name.endswith(".tmp")]

    # Cancelled after the reference step: that step stays staged and is not redone.
    cancel.clear()
    clock2 = CancelAfter(cancel, 1 + 4)  # set on the last of the reference step's 4 samples: convert never starts
    pipe.hb = Heartbeat(enabled=False, notifier=Notifier({}), clock=clock2, cancel=cancel)
    with pytest.raises(BuildCancelled):
        pipe.build(BuildRequest("cpu", "fp16"))
    assert cache.entries() == []
    assert sorted(p.stem for p in (staged[0] / "steps").glob("*.json")) == ["reference"]

    cancel.clear()
    pipe.hb = Heartbeat(enabled=False, notifier=Notifier({}))
    report = pipe.build(BuildRequest("cpu", "fp16"))
    assert report["cache"] == "built" and report["resumed_steps"] == ["reference"]
    (entry,) = cache.entries()
    assert cache.verify_entry(entry.path) == []


def test_a_cancel_set_before_the_build_stops_it_before_any_work(tmp_path):
    cancel = threading.Event()
    cancel.set()
    pipe, cache = pipeline(tmp_path, Heartbeat(enabled=False, notifier=Notifier({}), cancel=cancel))
    with pytest.raises(BuildCancelled):
        pipe.build(BuildRequest("cpu", "fp32"))
    assert cache.entries() == []


def test_pulse_never_raises_for_callbacks_from_native_code():
    cancel = threading.Event()
    cancel.set()
    hb = Heartbeat(enabled=False, notifier=Notifier({}), cancel=cancel)
    hb.pulse()  # TensorRT's progress monitor calls this from C++
    with pytest.raises(BuildCancelled):
        hb.beat()
