"""Which recipe and build target a serving tier maps to; a background build's heartbeat (STATUS only)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from edge_agent.config import EnginesConfig, TierConfig
from edge_agent.engines.background import TierEngines, _StatusHeartbeat
from edge_agent.engines.recipes import load_recipe
from edge_agent.engines.resolve import same_model, target_of
from edge_agent.shipped import engines_dir
from edge_agent.systemd import Notifier

RECIPE = """
name = "{name}"
model = "{model}"
workload = "{workload}"
targets = {targets}
precisions = ["fp32"]
"""


def write(folder: Path, name: str, model: str, workload: str = "llm", targets: str = '["cpu"]') -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(RECIPE.format(name=name, model=model, workload=workload, targets=targets))
    return path


@pytest.mark.parametrize(
    "backend, device, target",
    [
        ("onnxruntime", "cpu", "cpu"),
        ("openvino", "CPU", "cpu"),
        ("openvino", "NPU", "intel-npu"),
        ("openvino", "npu.0", "intel-npu"),
        ("tensorrt", "cuda:0", "jetson"),
    ],
)
def test_target_of_a_tier(backend: str, device: str, target: str) -> None:
    assert target_of(TierConfig(name="t", model="demo-phi3", backend=backend, device=device)) == target


def test_same_model_by_demo_name_or_by_folder_relative_to_the_recipe(tmp_path: Path) -> None:
    demo = load_recipe(write(tmp_path / "r", "a", "demo-phi3"))
    assert same_model(demo, "demo-phi3") and not same_model(demo, "demo-gemma")
    (tmp_path / "models" / "phi").mkdir(parents=True)
    folder = load_recipe(write(tmp_path / "r", "b", "../models/phi"))
    assert same_model(folder, str(tmp_path / "models" / "phi"))
    assert same_model(folder, str(tmp_path / "models" / ".." / "models" / "phi"))
    assert not same_model(folder, "demo-phi3") and not same_model(folder, str(tmp_path / "models"))


def test_recipes_of_configured_tiers_only_llm_matching_target_and_broken_ones_skipped(tmp_path: Path) -> None:
    recipes = tmp_path / "recipes"
    write(recipes, "phi", "demo-phi3")
    # invalid: speech on the NPU needs a fixed shape profile (LLMs get the plugin's LLM mode instead)
    write(recipes, "asr-npu", "demo-asr", workload="asr", targets='["intel-npu"]')
    write(recipes, "asr", "demo-asr", workload="asr")
    write(recipes, "gemma2-cpu", "demo-gemma2", targets='["cpu"]')
    (recipes / "broken.toml").write_text("name = [")
    engines = TierEngines(
        EnginesConfig(cache_dir=tmp_path / "c", recipes_dir=recipes),
        tmp_path / "m",
        on_event=lambda k, p: None,
        notifier=Notifier({}),
    )
    tiers = [
        TierConfig(name="a", model="demo-phi3"),
        TierConfig(name="b", model="demo-asr"),
        TierConfig(name="c", model="demo-gemma2", backend="tensorrt", device="cuda:0"),
        TierConfig(name="d", model="demo-phi3", backend="openvino", device="CPU"),
    ]
    shipped = [p.stem for p in sorted(engines_dir().glob("*.toml"))]  # in file-name order, as they are read
    # the user's folder first, then the shipped recipes (none of those is hidden here: no name is shared)
    assert [r.name for r in engines.all_recipes()] == ["asr", "gemma2-cpu", "phi", *shipped]
    assert engines.recipes(tiers) == ["phi"]  # ASR is not a tier recipe; gemma2-cpu does not build for jetson (tier c)
    assert engines.recipe_for(tiers[3]).name == "phi"  # the CPU target builds OpenVINO too


def test_a_background_build_sends_status_lines_and_never_extends_the_timeout(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "n.sock"))
    sock.settimeout(1)
    now = [0.0]
    hb = _StatusHeartbeat(Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")}), "building engine x fp32 (1/1)")
    hb.clock = lambda: now[0]
    hb.beat()
    hb.bar("gate onnxruntime/fp32", "samples")
    hb.bar("speed", "samples")  # within 5 s: not sent
    now[0] = 6.0
    hb.beat()
    hb.bar("speed fp32 (round 1/3)", "samples")
    got = [sock.recv(4096).decode() for _ in range(2)]
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)
    sock.close()
    assert got == [
        "STATUS=building engine x fp32 (1/1): gate onnxruntime/fp32",
        "STATUS=building engine x fp32 (1/1): speed fp32 (round 1/3)",
    ]
