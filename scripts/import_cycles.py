"""Import cycles among the modules of ``edge_agent/``, found from the source with ``ast`` alone.

    python scripts/import_cycles.py                  # prints each cycle, exits 1 when there is one
    python scripts/import_cycles.py --type-checking  # also counts imports under ``if TYPE_CHECKING:``
    python scripts/import_cycles.py --graph          # also prints every module's imports

Every ``import`` and ``from ... import`` anywhere in a module counts, also those inside functions: a
deferred import hides a cycle from the interpreter, not from a reader. Imports under
``if TYPE_CHECKING:`` (annotations only, never executed) count only with ``--type-checking``; the
import-linter contracts in pyproject.toml leave them out too.

``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``. A
cycle is a strongly connected component of two or more modules (Tarjan); a package's ``__init__``
importing its own submodules is no cycle unless one of them imports the package back.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under ``package``."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is, or lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                hidden.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return hidden


def imports(module: str, path: Path, known: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The known modules ``module`` imports (itself excluded)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_checking else _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg
            targets = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix for alias in node.names
            ]
        else:
            continue
        for target in targets:
            hit = _resolve(target, known)
            if hit is not None and hit != module:
                out.add(hit)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def package_cycles(package: Path, type_checking: bool = False) -> list[list[str]]:
    known = modules(package)
    return cycles({name: imports(name, path, known, type_checking) for name, path in known.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=ROOT / "edge_agent")
    parser.add_argument("--type-checking", action="store_true", help="count imports under if TYPE_CHECKING: too")
    parser.add_argument("--graph", action="store_true", help="print every module's imports too")
    args = parser.parse_args(argv)
    known = modules(args.package)
    graph = {name: imports(name, path, known, args.type_checking) for name, path in known.items()}
    if args.graph:
        for name in sorted(graph):
            print(f"{name}: {', '.join(sorted(graph[name])) or '-'}")
    found = cycles(graph)
    for component in found:
        print("cycle: " + " <-> ".join(component))
    print(f"{len(found)} import cycle(s) among {len(known)} modules of {args.package.name}/")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
