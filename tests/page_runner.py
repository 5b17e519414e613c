"""Runs the steps tests/test_page_commands.py plans from the pages' commands, in one Python
process: each page's steps in page order, in a fresh folder of its own, the way the page's
reader would type them, and returns what each did.

    python tests/page_runner.py STEPS.json FOLDER     # -> FOLDER/results.json

A step is ``{"page", "line", "program", "args", "mode"}``. `program` is ``hlm`` (also
``python -m hlm_ray.cli``), ``sweep:KIND`` (``python sweeps/KIND.py``), ``bench``
(``python -m hlm_ray.bench``) or ``make``. `mode` ``run`` calls the program's own entry point
with `args` (the `hlm` command's `main`, the sweep script's `main`, ...); ``parse`` only parses
`args` with the program's parser (argparse exits 2 on an unknown flag or a bad value; a command
configured by a preset also builds its config, which checks its ``--set`` fields). ``make``
runs ``make -n`` in the checkout. A command that another page gave with the same arguments is
not run again (what runs here writes nothing: the test checks). A step that runs here must start nothing: `ray.init` is
refused (a dry run or a --help that starts Ray is a fault).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class StartedRay(RuntimeError):
    pass


@contextlib.contextmanager
def _ray_refused():
    """`ray.init` raises while in the block (and is put back after it)."""
    import ray

    def refuse(*_args, **_kwargs):
        raise StartedRay("this step called ray.init: a --dry-run or --help must start nothing")

    init, ray.init = ray.init, refuse
    try:
        yield
    finally:
        ray.init = init


def _entry(program: str, mode: str):
    """The callable that takes the step's args: the program's main, or its parser's parse."""
    if program == "hlm":
        from hlm_ray.cli import build_parser, main

        return main if mode == "run" else lambda args: _parse_hlm(build_parser(), args)
    if program.startswith("sweep:"):
        from hlm_ray.tune.scripts import load_script

        script = load_script(program.split(":", 1)[1])
        prog = f"python sweeps/{script.SCRIPT.axis.name}.py"
        if mode == "run":
            return script.main
        return script.SCRIPT.parser(prog).parse_args
    if program == "bench":
        import argparse

        from hlm_ray.bench.cli import add_arguments, main

        if mode == "run":
            return main
        parser = argparse.ArgumentParser(prog="python -m hlm_ray.bench")
        add_arguments(parser)
        return parser.parse_args
    raise ValueError(f"no such program {program!r}")


def _parse_hlm(parser, args: list[str]) -> int:
    """Parse `args`; a command whose config is a preset's (`--preset`, `--config`, `--set`:
    data prepare, compare) also builds that config, so a misspelt `--set` field fails as it
    would when the command runs. (Fine-tuning's --set applies to the model's own config.)"""
    from hlm_ray.errors import HLMError
    from hlm_ray.presets import load_config

    ns = parser.parse_args(args)
    if not {"preset", "config", "set"} <= set(vars(ns)) or getattr(ns, "resume", None):
        return 0
    try:
        objective = getattr(ns, "objective", None)
        load_config(ns.preset or "tiny-decoder", objective=objective, yaml_file=ns.config,
                    overrides=ns.set)  # fmt: skip
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def run_step(step: dict) -> dict:
    """{"rc", "out", "seconds"} of one step, run in the current folder."""
    start = time.perf_counter()
    if step["program"] == "make":
        proc = subprocess.run(
            ["make", "-n", *step["args"]], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        out = proc.stdout + proc.stderr
        return {"rc": proc.returncode, "out": out[-4000:], "seconds": time.perf_counter() - start}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            result = _entry(step["program"], step["mode"])(list(step["args"]))
            rc = result if isinstance(result, int) else 0  # parse_args returns a Namespace
        except SystemExit as stop:
            rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception:  # a step's crash is its result, not the runner's
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "out": out.getvalue()[-4000:], "seconds": time.perf_counter() - start}


def run_steps(steps: list[dict], folder: Path) -> list[dict]:
    """Each page's steps in order, in FOLDER/<page> (made fresh); each step's result with the
    files its page's folder holds after it."""
    here = Path.cwd()
    results = []
    done: dict[tuple, dict] = {}  # the same command on another page: its result again
    with _ray_refused():
        for step in steps:
            page_dir = folder / step["page"].replace("/", "_")
            page_dir.mkdir(parents=True, exist_ok=True)
            key = (step["program"], tuple(step["args"]), step["mode"])
            if key not in done:
                os.chdir(page_dir)
                try:
                    done[key] = run_step(step)
                finally:
                    os.chdir(here)
            files = sorted(p.name for p in page_dir.iterdir())
            results.append({**step, **done[key], "files": files})
    return results


if __name__ == "__main__":
    steps_file, out_folder = sys.argv[1:3]
    found = run_steps(json.loads(Path(steps_file).read_text()), Path(out_folder))
    (Path(out_folder) / "results.json").write_text(json.dumps(found))
