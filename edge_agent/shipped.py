"""The data that ships with edge-agent: engine recipes, calibration manifests, the systemd unit and
the speech synthesiser that makes the calibration audio.

Their only source is the repository's top level (``engines/``, ``calibration/``, ``systemd/``,
``scripts/train_asr/synth.py``). A wheel carries a copy under ``edge_agent/data/`` with the same
layout (made by ``setup.py`` at build time, never committed); a checkout (editable install) reads
them where they are. Either way a recipe's ``../calibration/...`` path points at the shipped data.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_PACKAGED = _PACKAGE / "data"
_CHECKOUT = _PACKAGE.parent


def data_root() -> Path:
    """The folder holding ``engines/``, ``calibration/``, ``systemd/``: the wheel's copy, else the checkout."""
    return _PACKAGED if (_PACKAGED / "engines").is_dir() else _CHECKOUT


def is_packaged(path: Path) -> bool:
    """True for a path inside the installed package data (read-only under systemd; never written to)."""
    try:
        Path(path).resolve().relative_to(_PACKAGED)
    except ValueError:
        return False
    return True


def engines_dir() -> Path:
    return data_root() / "engines"


def calibration_dir() -> Path:
    return data_root() / "calibration"


def systemd_dir() -> Path:
    return data_root() / "systemd"


def synth_script() -> Path:
    return data_root() / "scripts" / "train_asr" / "synth.py"


def under_systemd() -> bool:
    """Started by systemd: it sets INVOCATION_ID for every service, STATE_DIRECTORY with StateDirectory=."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("STATE_DIRECTORY"))


def default_recipes_dir() -> Path:
    """The user's recipe folder, searched before the shipped recipes (``engines.recipes_dir``)."""
    if under_systemd():
        return Path("/etc/edge-agent/engines")
    import platformdirs

    return Path(platformdirs.user_config_dir("edge-agent")) / "engines"
