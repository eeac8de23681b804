"""edge-agent installed as a user installs it, dependencies and all: the wheel into fresh venvs with
pip resolving from the package index, with no extras (``pip install edge-agent``) and with
``[build]`` alone. Where ``test_wheel.py`` borrows this environment's packages (fast, offline), this
proves the declared dependencies are enough: a plain install transcribes a file with the shipped
demo ASR model, and ``[build]`` builds the shipped ``demo-asr`` recipe (both read audio with
soundfile, a core dependency).

Needs the package index (pypi.org, or pip's configured index); skipped with the reason without it.
Slow: two venvs (pip's cache shares the downloads between them).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.install.test_wheel import _sources, _user_env

pytestmark = pytest.mark.slow
soundfile = pytest.importorskip("soundfile")  # writes the test's WAV here


def _index_reachable() -> bool:
    if os.environ.get("PIP_INDEX_URL") or os.environ.get("PIP_NO_INDEX"):
        return True  # a configured index (or none on purpose): pip's own error says what is wrong
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _index_reachable():
        pytest.skip("the package index (pypi.org) cannot be reached: installing with dependencies needs it")
    tmp = tmp_path_factory.mktemp("wheel-deps")
    src, dist = _sources(tmp / "src"), tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check", str(src), "-w", dist],
        check=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    [built] = (tmp / "dist").glob("edge_agent-*.whl")
    return built


def _venv_with(wheel: Path, where: Path, extras: str = "") -> Path:
    """A fresh venv with the wheel and what its metadata declares (for ``extras``), nothing else."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    py = where / "bin" / "python"
    done = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel}{extras}"],
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return where


def test_a_plain_install_transcribes_a_file(wheel: Path, tmp_path: Path) -> None:
    venv = _venv_with(wheel, tmp_path / "venv")
    wav = tmp_path / "quiet.wav"
    soundfile.write(wav, np.random.default_rng(0).normal(0, 0.01, 16000).astype(np.float32), 16000)
    done = subprocess.run(
        [str(venv / "bin" / "edge-agent"), "transcribe", str(wav), "--model", "demo-asr", "--json"],
        cwd="/",
        env=_user_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "text" in json.loads(done.stdout)
    # only what the metadata declares is there: the microphone's package stays in [audio]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import sounddevice"], capture_output=True)
    assert probe.returncode != 0


def test_build_alone_builds_the_shipped_asr_recipe(wheel: Path, tmp_path: Path) -> None:
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.skip("the recipe's calibration audio is synthesised: apt install espeak-ng sox")
    venv = _venv_with(wheel, tmp_path / "venv", "[build]")
    home = tmp_path / "home"
    done = subprocess.run(
        [str(venv / "bin" / "edge-agent"), "build", "--recipe", "demo-asr", "--json", "-"],
        cwd="/",
        env=_user_env(home),
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout)["engines"]
    assert built and all(e["recipe"] == "demo-asr" for e in built)
