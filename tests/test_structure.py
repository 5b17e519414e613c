"""Facts about the package's shape: no import cycle, no module reaching into another's private
names, no source file (the package's, the sweep scripts', the cluster box's) over 500 lines.
Read from the source (ast), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]

PACKAGE = PROJECT_ROOT / "hlm_ray"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each hlm_ray import of `name`'s source,
    module-level or inside functions; `from pkg import submodule` counts as the submodule."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("hlm_ray")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if not base.startswith("hlm_ray"):
                continue
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    found.append((f"{base}.{alias.name}", []))
                else:
                    names.append(alias.name)
            if names:
                found.append((base, names))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        # A package's __init__ may re-export its submodules; a submodule importing a sibling
        # is an edge to that sibling, not to the package.
        graph[name] = {target for target, _ in _imports(name, path) if target in MODULES}
        graph[name].discard(name)
    return graph


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodules (re-exports)
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_private_name_imported_from_another_module():
    offenders = [
        f"{name} imports {target}.{n}"
        for name, path in MODULES.items()
        for target, names in _imports(name, path)
        for n in names
        if n.startswith("_") and target != name
    ]
    assert offenders == []


SCRIPTS = sorted(
    [*(PROJECT_ROOT / "deploy").rglob("*.py"), *(PROJECT_ROOT / "sweeps").glob("*.py")]
)
"""The scripts beside the package (the cluster box, the sweeps): held to the same limit."""


def test_no_source_file_over_the_limit():
    long = {
        str(path.relative_to(PROJECT_ROOT)): n
        for path in [*MODULES.values(), *SCRIPTS]
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
