"""The user-facing pages (README.md, docs/*.md, deploy/README.md) checked as a reader uses them:
every command they show parses, followed in order in a fresh folder each reads only what an
earlier one made (and no sweep name is reused with other settings), every relative link
resolves, and no page carries the project's work history. Plain text and argparse only: no Ray,
no MLflow, nothing run (tests/test_walkthrough.py and test_readme.py run their pages' commands;
tests/test_page_commands.py runs every page's commands that cost seconds, their dry runs and helps).

    PYTHONPATH=. python -m pytest -q tests/test_docs.py

What a command is: a line (``\\`` continuations joined, comments dropped) of a fenced ```bash
block, split at ``;``, ``&&``, ``||``, ``|`` and ``&``; leading ``NAME=value`` assignments are
skipped. ``hlm ...`` and ``python -m hlm_ray.cli ...`` go through the real ``hlm`` parser,
``python sweeps/X.py ...`` through ``hlm sweep X ...`` (the same parser as the script's own),
``python -m hlm_ray.bench ...`` through the benchmark's, ``make X`` must name a Makefile target;
``ray job submit ... -- CMD`` and ``bash -c 'CMD'`` are checked as CMD. Other programs (ray,
curl, kubectl, mlflow) are not ours to parse.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "deploy" / "README.md"]
    if p.is_file()
)

FENCE_RE = re.compile(r"^```[ \t]*(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SEPARATORS = {";", "&&", "||", "|", "&"}
ASSIGNMENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SWEEP_SCRIPT_RE = re.compile(r"(?:^|/)sweeps/(\w+)\.py$")


# ----------------------------------------------------------------------------- commands


def bash_blocks(text: str) -> list[str]:
    """The bodies of the fenced ```bash (or sh / shell / console) blocks of a page."""
    return [body for lang, body in FENCE_RE.findall(text) if lang in ("bash", "sh", "shell")]


def _strip_comment(line: str) -> str:
    """`line` up to its comment: a `#` at the start of a word, outside quotes (as bash reads
    it: `http://host/#/x` and `a#b` keep theirs)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands(block: str) -> list[list[str]]:
    """The simple commands of a bash block, each as its words (assignments in front dropped)."""
    joined = re.sub(r"\\\n", " ", block)
    found = []
    for line in joined.splitlines():
        line = _strip_comment(line).strip()
        if not line:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = ""
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in SEPARATORS:
                while words and ASSIGNMENT_RE.match(words[0]):
                    words.pop(0)
                if words:
                    found.append(words)
                words = []
            else:
                words.append(token)
    return found


@cache
def hlm_parser() -> argparse.ArgumentParser:
    from hlm_ray.cli import build_parser

    return build_parser()


@cache
def bench_parser() -> argparse.ArgumentParser:
    from hlm_ray.bench.cli import add_arguments

    parser = argparse.ArgumentParser(prog="python -m hlm_ray.bench")
    add_arguments(parser)
    return parser


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.MULTILINE))


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when `parser` accepts `args` (parse_args: an unknown flag is an error), else its
    message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as stop:
        if stop.code not in (0, None):  # --help / --version exit 0
            return err.getvalue().strip().splitlines()[-1] if err.getvalue() else str(stop)
    return None


def check_command(words: list[str]) -> tuple[bool, str | None]:
    """(whether the command is one of ours, the error when it does not parse)."""
    program, args = words[0], words[1:]
    if program == "hlm":
        return True, _parse(hlm_parser(), args)
    if program == "make":
        missing = [t for t in args if not t.startswith("-") and t not in make_targets()]
        return True, (f"no Makefile target {missing}" if missing else None)
    if re.fullmatch(r"(?:\S*/)?python3?", program) and args:
        if args[:2] == ["-m", "hlm_ray.cli"]:
            return True, _parse(hlm_parser(), args[2:])
        if args[:2] == ["-m", "hlm_ray.bench"]:
            return True, _parse(bench_parser(), args[2:])
        script = SWEEP_SCRIPT_RE.search(args[0])
        if script:
            if not (ROOT / "sweeps" / f"{script[1]}.py").is_file():
                return True, f"no script sweeps/{script[1]}.py"
            return True, _parse(hlm_parser(), ["sweep", script[1], *args[1:]])
        return False, None
    if words[:3] == ["ray", "job", "submit"] and "--" in words:
        inner = words[words.index("--") + 1 :]
        return check_command(inner) if inner else (False, None)
    if program in ("bash", "sh") and args[:1] == ["-c"] and len(args) > 1:
        checked = [check_command(w) for w in commands(args[1])]
        errors = [e for ours, e in checked if ours and e]
        return any(ours for ours, _ in checked), (errors[0] if errors else None)
    return False, None


def page_commands(page: str) -> list[tuple[str, str | None]]:
    """(command text, error or None) for every command of ours on `page`."""
    text = (ROOT / page).read_text()
    out = []
    for block in bash_blocks(text):
        for words in commands(block):
            ours, error = check_command(words)
            if ours:
                out.append((shlex.join(words), error))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_command_on_the_page_parses(page):
    checked = page_commands(page)
    bad = [f"{command}\n    -> {error}" for command, error in checked if error]
    assert not bad, f"{page}: commands the real parsers refuse:\n" + "\n".join(bad)


def test_the_command_check_can_fail():
    """A wrong flag, a wrong subcommand, a missing sweep script or make target, in each of the
    forms a page writes them, are caught; their right forms pass."""
    block = "\n".join(
        [
            "HLM_API_KEY=$KEY hlm serve --model runs/x --no-such-flag   # comment",
            "hlm tarin --preset tiny-decoder",
            "python sweeps/vocab.py --preset tiny --bogus",
            "python sweeps/nosuch.py --preset tiny",
            "make no-such-target",
            "RAY_AUTH_MODE=token ray job submit --working-dir . -- \\",
            "    hlm train --preset tiny-decoder --wrong 1",
            "ray job submit -- bash -c 'cd /x && python sweeps/vocab.py --preset nosuch'",
            "PYTHONPATH=. python -m hlm_ray.cli train --nope && echo done",
            "python -m hlm_ray.bench --preset nosuch",
        ]
    )
    checked = [check_command(words) for words in commands(block)]
    assert [ours for ours, _ in checked] == [True] * 8 + [False, True]  # `echo done` is not ours
    assert all(error for ours, error in checked if ours), checked
    good = "\n".join(
        [
            "HLM_API_KEY=$KEY hlm serve --model runs/x   # the same, right",
            "hlm train --preset tiny-decoder --output runs/a \\",
            "    --set optim.max_steps=20",
            "python sweeps/vocab.py --preset tiny --dry-run",
            "make demo",
            "RAY_AUTH_MODE=token ray job submit --working-dir . -- python sweeps/vocab.py",
            "PYTHONPATH=. python -m hlm_ray.cli train --preset tiny-decoder --local | tee log",
            "python -m hlm_ray.bench --preset smoke",
            "hlm --version",
            "curl -s http://127.0.0.1:8000/#/x -H 'a#b'",
        ]
    )
    checked = [check_command(words) for words in commands(good)]
    assert [error for _, error in checked] == [None] * 10, checked
    assert [ours for ours, _ in checked] == [True] * 6 + [False] + [True] * 2 + [False]  # tee, curl


# ----------------------------------------------------------------------------- in order

# Pages that continue another (their text says so): what that page made is there.
FOLLOWS = {"README.md": ["docs/walkthrough.md"], "deploy/README.md": ["docs/finetune.md"]}
# Sweep names that `make demo` (the README's first command) and the walkthrough have used.
DEMO_SWEEPS = {"demo": "python sweeps/vocab.py --preset tiny"}
PLACEHOLDER_RE = re.compile(r"[<$A-Z]|^/|^~")  # RUN, <run>, $RUN, absolute paths: the reader's


def _flag(words: list[str], name: str) -> str | None:
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _inner(words: list[str]) -> list[str]:
    """The command a `ray job submit ... --` wraps, else `words`."""
    if words[:3] == ["ray", "job", "submit"] and "--" in words:
        return words[words.index("--") + 1 :]
    return words


def flow_errors(pages: list[str]) -> list[str]:
    """Commands that would fail when `pages` are followed top to bottom in a fresh folder:
    a run, checkpoint or model read (`--model`, `--resume`, `data.prepared=`) that no earlier
    command made (`--output`, `--register NAME [--alias A]`, a sweep's `--name`), and a sweep
    name used again with other settings (a sweep refuses that: it needs its own `--name`)."""
    made: set[str] = set()
    sweeps = dict(DEMO_SWEEPS)
    errors = []
    for page in pages:
        for block in bash_blocks((ROOT / page).read_text()):
            for words in map(_inner, commands(block)):
                ours, _ = check_command(words)
                if not ours or "--help" in words or "--dry-run" in words:
                    continue
                text = shlex.join(words)
                script = SWEEP_SCRIPT_RE.search(words[1]) if len(words) > 1 else None
                if script:
                    name = _flag(words, "--name") or default_sweep_name(script[1], words)
                    settings = shlex.join(w for w in words if w != name)
                    settings = re.sub(r" --name\b", "", settings)
                    earlier = sweeps.setdefault(name, settings)
                    if earlier != settings:
                        errors.append(f"{page}: {text}\n    -> sweep name {name!r} already used "
                                      f"by `{earlier}`; give it its own --name")  # fmt: skip
                    made.add(f"runs/sweeps/{name}")
                reads = [_flag(words, "--model"), _flag(words, "--resume")]
                reads += [w.split("=", 1)[1] for w in words if w.startswith("data.prepared=")]
                for path in filter(None, reads):
                    if PLACEHOLDER_RE.search(path) or _is_made(path, made):
                        continue
                    errors.append(f"{page}: {text}\n    -> reads {path}, which no earlier "
                                  "command on the page makes")  # fmt: skip
                if (out := _flag(words, "--output")) is not None:
                    made.add(out.rstrip("/"))
                if (name := _flag(words, "--register")) is not None:
                    made.add(f"models:/{name}/1")
                    if (alias := _flag(words, "--alias")) is not None:
                        made.add(f"models:/{name}@{alias}")
    return errors


def default_sweep_name(script: str, words: list[str]) -> str:
    """A sweep's folder name without --name (`hlm_ray.tune.cli.default_name`, the headline's
    `curve_args`)."""
    name = f"{script}-{_flag(words, '--preset') or 'tiny'}"
    return (
        name + ("-search" if "--search" in words else "") + ("-curve" if "--curve" in words else "")
    )


def _is_made(path: str, made: set[str]) -> bool:
    path = path.rstrip("/")
    return any(path == m or path.startswith(m + "/") for m in made)


@pytest.mark.parametrize("page", PAGES)
def test_each_page_followed_in_order_in_a_fresh_folder_makes_what_it_reads(page):
    """What a reader meets following the page top to bottom in a fresh folder, checked from the
    commands (the walkthrough's and the README's own tests run theirs): nothing is read before
    a command makes it, and no sweep name is used twice with other settings."""
    errors = flow_errors([*FOLLOWS.get(page, []), page])
    assert not errors, "\n".join(errors)


def test_the_in_order_check_can_fail(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "hlm finetune --task clm --model runs/never-made --output runs/gen\n"
        "hlm eval --model runs/gen/model --task bpb\n"  # made just above: fine
        "hlm serve --model models:/hlm-x@candidate\n"
        "python sweeps/vocab.py --preset tiny --set optim.max_steps=20 --name demo\n"
        "python sweeps/vocab.py --preset tiny --set optim.max_steps=20 --name mine\n"
        "python sweeps/vocab.py --preset tiny --set optim.max_steps=30 --name mine\n"
        "hlm eval --model RUN --task bpb\n"  # a placeholder: the reader's own
        "```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    errors = flow_errors(["page.md"])
    assert len(errors) == 4, errors
    assert "reads runs/never-made" in errors[0] and "reads models:/hlm-x@candidate" in errors[1]
    assert "'demo' already used" in errors[2] and "'mine' already used" in errors[3]


def test_bash_blocks_and_continuations_are_read_as_bash_reads_them():
    text = "x\n```bash\nhlm train \\\n  --local  # why\nexport A=1; hlm presets\n```\n```python\nhlm x\n```\n"
    [block] = bash_blocks(text)
    assert commands(block) == [
        ["hlm", "train", "--local"],
        ["export", "A=1"],
        ["hlm", "presets"],
    ]


STAGE_PAGES = ["training", "sweeps", "tracking", "finetune", "serving", "data", "clusters", "gpus"]
"""The page per stage under docs/: each opens with its commands."""


def opens_with_commands(text: str) -> bool:
    """Whether the first thing after the page's title is a fenced bash block."""
    body = re.sub(r"\A\s*#[^\n]*\n", "", text, count=1).lstrip()
    return bool(re.match(r"```(?:bash|sh|shell)\n", body))


@pytest.mark.parametrize("stage", STAGE_PAGES + ["benchmarks"])
def test_each_stage_page_opens_with_its_commands(stage):
    path = ROOT / "docs" / f"{stage}.md"
    if not path.is_file():
        pytest.skip(f"docs/{stage}.md is not in this checkout")
    assert opens_with_commands(path.read_text()), f"docs/{stage}.md: start with a ```bash block"


def test_the_opening_check_can_fail():
    assert opens_with_commands("# T\n\n```bash\nhlm presets\n```\ntext\n")
    assert not opens_with_commands("# T\n\nSome prose first.\n\n```bash\nhlm presets\n```\n")
    assert not opens_with_commands("# T\n\n```python\nimport hlm_ray\n```\n")


# ----------------------------------------------------------------------------- links


def _without_code(text: str) -> str:
    text = FENCE_RE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to
    hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", FENCE_RE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    """Relative links and images of `page` whose file (or heading anchor) does not exist."""
    text = _without_code(page.read_text())
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, re.MULTILINE)
    targets += re.findall(r"<img[^>]*\ssrc=\"([^\"]+)\"", text)
    bad = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target} (no heading #{anchor} in {file.name})")
    return bad


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_image_resolves(page):
    bad = broken_links(ROOT / page)
    assert not bad, f"{page}: broken links: {bad}"


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](../there.md#a-heading-with-code) [gone](missing.md) ![img](figures/none.png)\n"
        "[bad anchor](../there.md#nowhere) [web](https://example.com/x.md) [self](#top)\n"
        "# Top\n`[in code](nothing.md)`\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "figures/none.png (no such file)",
        "../there.md#nowhere (no heading #nowhere in there.md)",
    ]


# ----------------------------------------------------------------------------- named files and tests

# docs/ pages are checked as links; a file here is one the text names in code spans or prose.
PATH_RE = re.compile(r"(?<![\w./-])((?:hlm_ray|tests|sweeps|deploy)/[\w./-]*\w)")
TEST_RE = re.compile(r"(?<![\w.])(?:(test_\w+)\.py::)?(test_\w+)(?:\[[^\]]*\])?(?![\w.])")


@cache
def defined_tests() -> dict[str, set[str]]:
    """Every test function, by test file stem."""
    return {
        f.stem: set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", f.read_text(), re.M))
        for f in (ROOT / "tests").glob("test_*.py")
    }


def missing_names(text: str) -> list[str]:
    """Files of the project (hlm_ray/..., tests/..., sweeps/..., deploy/...) and tests
    (test_x, test_file.py::test_x) that a page names and that do not exist."""
    bad = []
    for path in PATH_RE.findall(text):
        placeholder = re.search(r"[*<]|/(?!README)[A-Z]+(?:[./]|$)", path)  # sweeps/NAME.py
        if not placeholder and not (ROOT / path).exists():
            bad.append(path)
    every = set().union(*defined_tests().values())
    for file, name in TEST_RE.findall(text):
        if file:
            if name not in defined_tests().get(file, set()):
                bad.append(f"{file}.py::{name}")
        elif name not in every and name not in defined_tests():
            bad.append(name)
    return bad


@pytest.mark.parametrize("page", PAGES)
def test_every_file_and_test_a_page_names_exists(page):
    bad = missing_names((ROOT / page).read_text())
    assert not bad, f"{page} names what is not in the project: {sorted(set(bad))}"


def test_the_names_check_can_fail():
    text = (
        "`hlm_ray/objectives.py`, `hlm_ray/nowhere.py`, `tests/test_docs.py::test_no_such`, "
        "`test_the_names_check_can_fail`, `test_missing_everywhere[x]`, `runs/sweeps/<name>/`, "
        "`sweeps/NAME.py`, deploy/README.md"
    )
    assert missing_names(text) == [
        "hlm_ray/nowhere.py",
        "test_docs.py::test_no_such",
        "test_missing_everywhere",
    ]


# ----------------------------------------------------------------------------- history

HISTORY_PATTERNS = {
    "an issue number": r"(?<![\w&/])#\d+\b|\b(?:issues?|PR|pull request)\s+#?\d+\b",
    "a commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
    "a machine path": r"/work/|/root/|/tmp/bash_jobs|/Users/|/home/(?!me/)",
    "work history": r"\bthis (?:branch|session|pass)\b|\bwas lent\b|\bother (?:agents|engineers)\b",
}


def history(text: str) -> list[str]:
    """Every match of the patterns above, named, with the line it is on."""
    found = []
    for line in text.splitlines():
        for what, pattern in HISTORY_PATTERNS.items():
            for match in re.finditer(
                pattern, line, re.IGNORECASE if what != "a commit hash" else 0
            ):
                found.append(f"{what} ({match[0]!r}): {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("page", PAGES)
def test_no_page_carries_the_projects_work_history(page):
    found = history((ROOT / page).read_text())
    assert not found, f"{page}:\n" + "\n".join(found)


def test_the_history_check_can_fail():
    text = (
        "fixed in issue 14 (#25) at 403ae31 by this branch\n"
        "scripts in /work/notes/x.sh; no GPU was lent\n"
        "sqlite:////home/me/hlm_ray/mlflow.db, http://h/#/experiments/1, 1,024 tokens, a7 ff\n"
    )
    found = history(text)
    assert [f.split(" (")[0] for f in found] == [
        "an issue number",
        "an issue number",
        "a commit hash",
        "work history",
        "a machine path",
        "work history",
    ], found
