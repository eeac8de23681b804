"""Build step: the wheel carries the shipped data as ``edge_agent/data/`` (see edge_agent/shipped.py).

The recipes (``engines/``), the calibration manifests (``calibration/``, without the synthesised
WAVs, which are made on first use), the systemd unit, the speech synthesiser and the service
installer (``scripts/install-service --wheel``, for a device that has the wheel only) stay where they are
in the repository, their only source; they are copied into the build tree here. An editable install
reads them in place and gets no copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("engines", "calibration", "systemd", "scripts/train_asr/synth.py", "scripts/install-service")
SKIP = shutil.ignore_patterns("*.wav", "*.tmp", "__pycache__", "*.pyc", ".gitignore")


class BuildPyWithData(build_py):
    """``build_py`` that also copies the shipped data into the wheel's ``edge_agent/data/``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        data = Path(self.build_lib) / "edge_agent" / "data"
        shutil.rmtree(data, ignore_errors=True)
        for rel in SHIPPED:
            src, dest = ROOT / rel, data / rel
            if src.is_dir():
                shutil.copytree(src, dest, ignore=SKIP)
            elif src.is_file():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
            else:
                raise FileNotFoundError(f"{src}: shipped data missing from the source tree")


setup(cmdclass={"build_py": BuildPyWithData})
