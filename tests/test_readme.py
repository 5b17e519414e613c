"""The README as a front page: short, its two commands real, its layout table the package's.

    PYTHONPATH=. python -m pytest -q tests/test_readme.py

Plain text, `make -n` and the file tree; nothing is run. (Every command and link of the README
is also checked by tests/test_docs.py, with the other pages.)
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200
TWO_COMMANDS = {
    "demo": "sweeps/vocab.py --preset tiny",  # what `make demo` must end up running
    "test": "-m pytest",
}


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a Markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\s*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match[1]


def layout_paths(text: str) -> list[str]:
    """The backticked paths in the first column of the Layout table."""
    rows = [line for line in section(text, "Layout").splitlines() if line.startswith("|")]
    return [p for row in rows[2:] for p in re.findall(r"`([^`]+)`", row.split("|")[1])]


def top_level_parts(package: Path) -> set[str]:
    """The package's top-level modules (`hlm_ray/x.py`) and subpackages (`hlm_ray/x/`)."""
    modules = {f"{package.name}/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"}
    packages = {
        f"{package.name}/{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()
    }
    return modules | packages


def unlisted_and_missing(paths: list[str], root: Path) -> tuple[list[str], list[str]]:
    """(top-level parts of hlm_ray/ the table does not name, named paths that do not exist)."""
    unlisted = sorted(top_level_parts(root / "hlm_ray") - set(paths))
    missing = [p for p in paths if not (root / p).exists()]
    return unlisted, missing


def test_readme_is_a_front_page_of_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_the_layout_table_names_every_module_and_package_and_only_real_paths():
    unlisted, missing = unlisted_and_missing(layout_paths(README.read_text()), ROOT)
    assert not unlisted, f"README's Layout table does not name: {unlisted}"
    assert not missing, f"README's Layout table names paths that do not exist: {missing}"


def test_the_layout_check_can_fail(tmp_path):
    """A new module left out of the table, and a row for a module that is gone, are caught."""
    package = tmp_path / "hlm_ray"
    (package / "train").mkdir(parents=True)
    for name in ("__init__.py", "config.py", "new_module.py", "train/__init__.py"):
        (package / name).write_text("")
    (package / "notes").mkdir()  # a folder that is not a package is not listed
    table = (
        "## Layout\n\n| path | job |\n|---|---|\n| `hlm_ray/config.py` | config |\n"
        "| `hlm_ray/train/` | training |\n| `hlm_ray/gone.py` | removed |\n\n## Next\n"
    )
    assert unlisted_and_missing(layout_paths(table), tmp_path) == (
        ["hlm_ray/new_module.py"],
        ["hlm_ray/gone.py"],
    )


def test_the_two_commands_are_on_the_readme_and_make_resolves_them():
    block = section(README.read_text(), "Two commands")
    for target, runs in TWO_COMMANDS.items():
        assert re.search(rf"^make {target}\b", block, re.M), f"README does not show `make {target}`"
        # Not the flags of a `make test` this suite may be running under.
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        dry = subprocess.run(
            ["make", "-n", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert dry.returncode == 0, f"make -n {target}: {dry.stderr}"
        assert runs in dry.stdout, f"`make {target}` no longer runs {runs!r}:\n{dry.stdout}"


def test_ci_runs_make_test():
    """`.ci/run` runs the README's test command (and the check sees one that does not)."""
    assert runs_make_test((ROOT / ".ci" / "run").read_text())
    assert runs_make_test("#!/bin/sh\ncd x && make test\n")
    assert not runs_make_test("#!/bin/sh\n# make test\npython -m pytest\n")


def runs_make_test(script: str) -> bool:
    """Whether a shell script has `make test` as a command (not in a comment)."""
    return any(
        re.search(r"(^|\s|;|&&)make test\b", line.split("#", 1)[0]) for line in script.splitlines()
    )
