"""Every command of ours on the user-facing pages (README.md, docs/*.md, deploy/README.md) run,
page by page in order, each page in a fresh folder, offline: what costs a second runs as written,
what would train or serve runs with `--dry-run` where the command has one, and the rest is
parsed by its program's own parser; every command's `--help` runs once per page.

    PYTHONPATH=. python -m pytest -q tests/test_page_commands.py

Which commands (extracted as tests/test_docs.py reads a page: ```bash blocks, continuations
joined, through ``ray job submit ... --`` and ``bash -c '...'``):

- as written: ``hlm --version``, ``hlm presets``, and any command the page itself gives
  ``--dry-run`` or ``--help``;
- with ``--dry-run`` appended: a command whose parser has it (``hlm train``, the sweeps), unless
  it resumes a run (``--resume``) that an earlier, costly command on the page makes;
- parsed only: the rest (fine-tuning, evaluation, serving, benchmarks, data preparation, ...):
  each costs minutes or needs what an earlier costly command makes; the flags the page uses
  must still be accepted, and a command configured by a preset (data prepare, compare) builds
  its config (its ``--set`` fields exist and their values fit). docs/walkthrough.md's commands are also run for real by
  tests/test_walkthrough.py; the order of what reads what is checked by test_docs.py;
- ``make TARGET``: ``make -n TARGET`` in the checkout.

All steps run in one Python process (tests/page_runner.py: one import of torch and Ray for all
pages), where `ray.init` is refused: a dry run or a --help starts nothing. The environment is a
reader's offline machine: ``HF_HUB_OFFLINE=1``, the shipped data (``HLM_DATA_DIR``), no
``RAY_ADDRESS``, no MLflow server. Dry runs of the paper presets must make their plan offline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import page_runner
from test_docs import PAGES, ROOT, SWEEP_SCRIPT_RE, bash_blocks, commands, hlm_parser

CHEAP = (["--version"], ["presets"])
"""`hlm` commands that run in a second: run as written wherever a page gives them."""
READS_A_RUN = ("--resume",)
"""Flags that read a run folder an earlier command makes (its dry run needs the folder)."""
DEADLINE_S = 600  # all pages' steps; about a minute on 2 busy cores


def our_commands(words: list[str]) -> list[tuple[str, list[str]]]:
    """(program, args) of each command of ours in `words` (see page_runner.py for programs),
    through ``ray job submit ... -- CMD`` and ``bash -c 'CMD; CMD'``."""
    if words[:3] == ["ray", "job", "submit"] and "--" in words:
        words = words[words.index("--") + 1 :]
    if not words:
        return []
    program, args = words[0], words[1:]
    if program == "hlm":
        return [("hlm", args)]
    if program == "make":
        return [("make", args)]
    if program in ("bash", "sh") and args[:1] == ["-c"] and len(args) > 1:
        return [found for inner in commands(args[1]) for found in our_commands(inner)]
    if os.path.basename(program) in ("python", "python3") and args:
        if args[:2] == ["-m", "hlm_ray.cli"]:
            return [("hlm", args[2:])]
        if args[:2] == ["-m", "hlm_ray.bench"]:
            return [("bench", args[2:])]
        if script := SWEEP_SCRIPT_RE.search(args[0]):
            return [(f"sweep:{script[1]}", args[1:])]
    return []


def command_words(program: str, args: list[str]) -> list[str]:
    """The subcommand words of `args` (``train``, ``data prepare``, ``sweep vocab``): what
    ``--help`` follows."""
    if program != "hlm":
        return []
    parser, words = hlm_parser(), []
    for arg in args:
        if arg not in _subcommands(parser):
            break
        parser, words = _subcommands(parser)[arg], [*words, arg]
    return words


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return found[0].choices if found else {}


@cache
def _sweep_has_dry_run(kind: str) -> bool:
    from hlm_ray.tune.scripts import load_script

    return "--dry-run" in load_script(kind).SCRIPT.parser()._option_string_actions


def has_dry_run(program: str, args: list[str]) -> bool:
    if program.startswith("sweep:"):
        return _sweep_has_dry_run(program.split(":", 1)[1])
    if program != "hlm":
        return False
    parser = hlm_parser()
    for word in command_words(program, args):
        parser = _subcommands(parser)[word]
    return "--dry-run" in parser._option_string_actions


def page_steps(page: str, text: str) -> list[dict]:
    """The steps for the page's commands, in page order (see the module's docstring)."""
    steps: list[dict] = []
    helped: set[tuple[str, ...]] = set()

    def step(line, program, args, mode, why):
        steps.append(dict(page=page, line=line, program=program, args=args, mode=mode, why=why))

    for block in bash_blocks(text):
        for words in commands(block):
            line = shlex.join(words)
            for program, args in our_commands(words):
                if program == "make":
                    step(line, program, args, "run", "make -n")
                    continue
                path = (program, *command_words(program, args))
                if path not in helped and "--help" not in args:
                    helped.add(path)
                    step(line, program, [*path[1:], "--help"], "run", "its --help")
                if args in CHEAP or "--dry-run" in args or "--help" in args:
                    step(line, program, args, "run", "as written")
                elif has_dry_run(program, args) and not set(args) & set(READS_A_RUN):
                    step(line, program, [*args, "--dry-run"], "run", "with --dry-run")
                else:
                    step(line, program, args, "parse", "parsed")
    return steps


def run_pages(pages: dict[str, str], folder: Path) -> list[dict]:
    """The steps of `pages` ({name: text}) run by tests/page_runner.py in one process, each
    page in a fresh folder under `folder`, offline; each step with its rc and output."""
    steps = [s for page, text in pages.items() for s in page_steps(page, text)]
    (folder / "steps.json").write_text(json.dumps(steps))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    env.setdefault("HLM_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    proc = subprocess.run(
        [sys.executable, str(Path(page_runner.__file__)), str(folder / "steps.json"), str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((folder / "results.json").read_text())


def failures(results: list[dict]) -> list[str]:
    """One paragraph per step that exited non-zero: the page's line, what ran, the output's end."""
    return [
        f"{r['page']}: {r['line']}\n    ran ({r['why']}): {r['program']} {shlex.join(r['args'])}"
        f"\n    -> exit {r['rc']}: {r['out'].strip()[-1500:]}"
        for r in results
        if r["rc"] != 0
    ]


def test_every_pages_commands_run_in_order_offline(tmp_path):
    results = run_pages({page: (ROOT / page).read_text() for page in PAGES}, tmp_path)
    bad = failures(results)
    assert not bad, "\n\n".join(bad)
    ran = {r["page"] for r in results}
    assert ran == {p for p in PAGES if page_steps(p, (ROOT / p).read_text())}, ran
    # A dry run, a --help and a parse start nothing and write nothing in the reader's folder.
    left = {r["page"]: r["files"] for r in results if r["files"]}
    assert not left, f"files a dry run or --help left in the page's folder: {left}"


def test_the_page_run_can_fail(tmp_path, monkeypatch):
    """A wrong flag (caught by parsing and by the dry run) and a missing prerequisite (a YAML
    file no command made, caught by the dry run) fail; their right forms pass. In this process:
    the same runner, without the subprocess."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    page = (
        "```bash\n"
        "hlm eval --model runs/gen --task bpb --no-such-flag\n"  # parsed: refused
        "hlm train --preset tiny-decoder --max-steps 10\n"  # dry run: refused flag
        "hlm train --preset tiny-decoder --config my.yaml\n"  # dry run: no my.yaml
        "python sweeps/vocab.py --preset tiny --set sweep.values=[]\n"  # dry run: bad value
        "make no-such-target\n"
        "hlm data prepare --preset tiny-decoder --set data.sorces=[x/] --output runs/p\n"  # parsed
        "```\n"
    )
    good = (
        "```bash\n"
        "hlm eval --model runs/gen --task bpb\n"
        "hlm train --preset tiny-decoder --set optim.max_steps=10\n"
        "python sweeps/vocab.py --preset tiny --set 'sweep.values=[512]'\n"
        "make demo\n"
        "hlm data prepare --preset tiny-decoder --set data.sources=[x/] --output runs/p\n"
        "```\n"
    )
    steps = page_steps("bad.md", page) + page_steps("good.md", good)
    assert [s["why"] for s in steps if s["page"] == "good.md"] == [
        *["its --help", "parsed", "its --help", "with --dry-run"],
        *["its --help", "with --dry-run", "make -n", "its --help", "parsed"],
    ]
    results = page_runner.run_steps(steps, tmp_path)
    assert len(results) == len(steps)
    bad = [r for r in results if r["page"] == "bad.md" and r["why"] != "its --help"]
    assert [r["rc"] != 0 for r in bad] == [True] * 6, bad
    assert "--no-such-flag" in bad[0]["out"] and "--max-steps" in bad[1]["out"]
    assert "my.yaml" in bad[2]["out"] and "data.sorces" in bad[5]["out"]
    assert not failures([r for r in results if r not in bad]), failures(results)


def test_page_steps_follow_the_page_in_order_through_job_submissions():
    text = (
        "```bash\n"
        "hlm --version\n"
        "ray job submit --working-dir . -- bash -c 'cd /x && python sweeps/vocab.py --preset paper'\n"
        "hlm train --resume runs/a --set optim.max_steps=300\n"
        "hlm data prepare --preset tiny-decoder --output runs/p && hlm data bench --size-mb 1\n"
        "python -m hlm_ray.bench --preset smoke | tee log\n"
        "```\n"
    )
    steps = [(s["program"], s["args"], s["mode"]) for s in page_steps("p.md", text)]
    assert steps == [
        ("hlm", ["--help"], "run"),  # no subcommand: the top-level help
        ("hlm", ["--version"], "run"),
        ("sweep:vocab", ["--help"], "run"),
        ("sweep:vocab", ["--preset", "paper", "--dry-run"], "run"),
        ("hlm", ["train", "--help"], "run"),
        ("hlm", ["train", "--resume", "runs/a", "--set", "optim.max_steps=300"], "parse"),
        ("hlm", ["data", "prepare", "--help"], "run"),
        ("hlm", ["data", "prepare", "--preset", "tiny-decoder", "--output", "runs/p"], "parse"),
        ("hlm", ["data", "bench", "--help"], "run"),
        ("hlm", ["data", "bench", "--size-mb", "1"], "parse"),
        ("bench", ["--help"], "run"),
        ("bench", ["--preset", "smoke"], "parse"),
    ]
