"""scripts/import_cycles.py: it finds a cycle where there is one, and edge_agent/ has none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_cycles"] = module
    spec.loader.exec_module(module)
    return module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_a_deferred_relative_import_closing_a_loop_is_a_cycle(tmp_path: Path) -> None:
    ic = _script()
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "from . import a\n",
            "a.py": "from .sub.b import f\n",
            "sub/__init__.py": "",
            "sub/b.py": "def f():\n    from ..a import g  # deferred: still a cycle\n",
            "c.py": "from . import a\n",  # depends on the loop, is not in it
        },
    )
    assert ic.package_cycles(pkg) == [["pkg.a", "pkg.sub.b"]]


def test_type_checking_imports_count_only_when_asked(tmp_path: Path) -> None:
    ic = _script()
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import B\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nclass B: ...\n",
        },
    )
    assert ic.package_cycles(pkg) == []
    assert ic.package_cycles(pkg, type_checking=True) == [["pkg.a", "pkg.b"]]


def test_a_package_importing_its_own_modules_is_no_cycle(tmp_path: Path) -> None:
    ic = _script()
    pkg = _package(tmp_path, {"__init__.py": "from . import a, b\n", "a.py": "from . import b\n", "b.py": "x = 1\n"})
    assert ic.package_cycles(pkg) == []


def test_edge_agent_has_no_import_cycle() -> None:
    assert _script().package_cycles(ROOT / "edge_agent") == []
