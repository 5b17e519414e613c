"""Every third-party package the code imports is declared in pyproject.toml: the package's and
the sweep scripts' imports in `dependencies`, the tests' in `dependencies` or the `dev` extra.

Imports are read with `ast` (module level and inside functions alike, so a lazy import counts);
import names are mapped to distributions by the installed environment's own table
(`importlib.metadata.packages_distributions`: yaml -> PyYAML, sklearn -> scikit-learn).
"""

import ast
import functools
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folders whose scripts the tests import as modules (by sys.path): not third-party packages.
LOCAL = ("tests", "deploy/box")
# Imported only inside a function, behind a check, and declared in an extra: (extra, why).
OPTIONAL = {
    "xformers": ("gpu", "CUDA only: the xformers attention backend and make gpu-check"),
    "liger_kernel": ("gpu", "CUDA only: objective.vanilla_impl=liger (hlm_ray/fused_ce.py)"),
    "cut_cross_entropy": ("gpu", "objective.vanilla_impl=cce | cce_compile (hlm_ray/fused_ce.py)"),
    "lm_eval": ("eval", "lm-evaluation-harness, only for `hlm eval --task harness:...`"),
}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normal(re.match(r"[A-Za-z0-9_.\-]+", r).group()) for r in requirements}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(*extras: str) -> set[str]:
    project = _project()
    names = _requirement_names(project["dependencies"])
    for extra in extras:
        for requirement in project["optional-dependencies"][extra]:
            own = re.fullmatch(r"hlm_ray\[([\w,]+)\]", requirement)
            if own:  # dev pulls in eval: hlm_ray[eval]
                names |= _declared(*own.group(1).split(","))
            else:
                names |= _requirement_names([requirement])
    return names


def imports(path: Path) -> dict[str, bool]:
    """{top-level module: imported at module level} for the absolute imports of a file."""
    found: dict[str, bool] = {}
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            found[top] = found.get(top, False) or id(node) in top_level
    return found


def third_party(folders: list[str]) -> dict[str, dict[str, bool]]:
    """{module: {file: imported at module level}} over the .py files of `folders`."""
    out: dict[str, dict[str, bool]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, eager in imports(path).items():
                if module in sys.stdlib_module_names or module in ("hlm_ray", "__future__"):
                    continue
                if folder == "tests" and any((ROOT / f / f"{module}.py").exists() for f in LOCAL):
                    continue  # a helper module of the tests, or the box's scripts they drive
                out.setdefault(module, {})[str(path.relative_to(ROOT))] = eager
    return out


@functools.cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    """The distributions that provide `module` here (its own name when not installed)."""
    provided = _providers().get(module)
    return {_normal(d) for d in provided} if provided else {_normal(module)}


def test_the_import_reader_sees_lazy_and_module_level_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\nimport yaml.x\ndef f():\n    from sklearn import svm\n")
    assert imports(path) == {"os": True, "yaml": True, "sklearn": False}
    assert distributions("yaml") == {"pyyaml"} and distributions("sklearn") == {"scikit-learn"}


@pytest.mark.parametrize(
    ("folders", "extras"), [(["hlm_ray", "sweeps"], ()), (["tests"], ("dev",))], ids=str
)
def test_every_imported_package_is_declared(folders, extras):
    declared = _declared(*extras)
    missing = {}
    for module, files in third_party(folders).items():
        if module in OPTIONAL:
            extra, _why = OPTIONAL[module]
            assert distributions(module) & _declared(extra), f"{module} not in the {extra} extra"
            eager = [f for f, at_top in files.items() if at_top]
            assert not eager, f"{module} is optional but imported at module level in {eager}"
            continue
        if not distributions(module) & declared:
            missing[module] = sorted(files)[:3]
    where = "dependencies" + "".join(f" or the {e} extra" for e in extras)
    assert not missing, f"imported but not declared in pyproject.toml {where}: {missing}"
