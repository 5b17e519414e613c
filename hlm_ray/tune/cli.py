"""The command line of every script in `sweeps/`: a script declares its `Axis`, its presets and
what only it does (its own flags, its report) in a `SweepScript`; `main` is the rest.

    SCRIPT = SweepScript(AXIS, PRESETS)                  # sweeps/temperature.py
    SCRIPT = SweepScript(AXIS, PRESETS, report=write_vocab_report)       # + its report
    main = SCRIPT.main                                   # main(argv, prog) -> exit status

    python sweeps/vocab.py --preset tiny
    python sweeps/vocab.py --preset tiny --set optim.max_steps=20 --set sweep.values=[512,768]
    python sweeps/batch_size.py --preset paper --workers-per-trial 2 --gpus-per-worker 1
    python sweeps/vocab.py --preset tiny --search --set sweep.search_samples=8
    python sweeps/vocab.py --preset paper --dry-run --gpu-type A100 --mfu 0.35   # the plan only

Exit status: 0 when every trial finished, 1 when some failed (they are in the summary), 2 on
bad input (one line, ``error: ...``), 130 after Ctrl-C (trials stopped, their runs and the
parent marked KILLED, the command that continues the sweep printed).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis
from hlm_ray.tune.spec import SweepSpec


@dataclass(frozen=True)
class SweepScript:
    """One `sweeps/*.py` script: the same command line as `python sweeps/<name>.py` and
    `hlm sweep <name>` (both build their parser with `parser`)."""

    axis: Axis
    presets: dict[str, SweepSpec]
    flags: Callable[[argparse.ArgumentParser], None] | None = None
    """Adds the script's own flags to the common ones (the headline's --curve)."""
    adjust: Callable[[argparse.Namespace, Axis], None] | None = None
    """Rewrites the parsed arguments before anything runs (--curve sets its families and the
    sweep's default name); raises `HLMError` on bad input."""
    report: Callable[[SweepSpec, str, str], list[Path]] | None = None
    """(spec, sweep name, preset) -> the files of the script's report in runs/sweeps/<name>,
    Markdown first; called after the trials of a grid sweep (not --dry-run, not --search)."""
    plan: Callable[[SweepSpec, argparse.Namespace, str], str] | None = None
    """(spec, arguments, name) -> what --dry-run prints, instead of the grid's cost plan (a
    script that runs more than its grid: the scaling sweep's search)."""
    run: Callable[[SweepSpec, argparse.Namespace, str], object] | None = None
    """(spec, arguments, name) -> the `SweepOutcome` to print, instead of one `run_sweep` of
    the grid (the scaling sweep runs its learning-rate search first)."""

    def parser(self, prog: str | None = None, **kwargs) -> argparse.ArgumentParser:
        p = build_parser(self.axis, self.presets, prog, **kwargs)
        if self.flags is not None:
            self.flags(p)
        return p

    def main(self, argv: list[str] | None = None, prog: str | None = None) -> int:
        """Parse `argv`, run the sweep, print its table (and report); the exit status. `prog`:
        the command that ran it (default ``python sweeps/<name>.py``), used in help and in the
        command printed to continue an interrupted sweep."""
        from hlm_ray.train.interrupt import EXIT_INTERRUPTED, sigint_interrupts

        sigint_interrupts()  # also in a sweep a script started in the background
        argv = list(sys.argv[1:] if argv is None else argv)
        prog = prog or f"python sweeps/{self.axis.name}.py"
        args = self.parser(prog).parse_args(argv)
        name = default_name(self.axis, args)
        try:
            if self.adjust is not None:
                self.adjust(args, self.axis)
            name = default_name(self.axis, args)
            spec = _get_spec(self.presets, args)
            if args.dry_run:
                print(self.plan(spec, args, name) if self.plan else _plan(spec, args, name))
                return 0
            runner = self.run or _run
            outcome = in_console(args, name, lambda verbose: runner(spec, args, name, verbose))
        except HLMError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # a second Ctrl-C: the parent run is KILLED already
            again = " ".join([prog, *(shlex.quote(a) for a in _with_name(argv, name))])
            print(f"\ninterrupted; continue with: {again}", file=sys.stderr)
            return EXIT_INTERRUPTED
        _print_table(outcome)
        if outcome.interrupted:
            killed = sum(r["status"] == "KILLED" for r in outcome.rows)
            again = " ".join([prog, *(shlex.quote(a) for a in _with_name(argv, name))])
            print(
                f"\ninterrupted: {killed} unfinished trial(s) stopped and marked KILLED; "
                f"continue with: {again}",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
        status = _print_outcome(outcome, args.search)
        if self.report is None or args.search:
            _print_link(outcome)
            return status
        try:
            files = self.report(spec, name, args.preset)
        except HLMError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print("\n" + console_text(files[0].read_text(), files[0].parent))
        print("report: " + ", ".join(str(p) for p in files))
        _print_link(outcome)
        return status


def build_parser(
    axis: Axis, presets: dict[str, SweepSpec], prog: str | None = None, **kwargs
) -> argparse.ArgumentParser:
    """The flags every script has; `prog` is how it was called (`hlm sweep vocab`), `kwargs`
    go to `ArgumentParser` (`hlm` builds its `sweep vocab` subcommand from this parser)."""
    kind = axis.name
    p = argparse.ArgumentParser(
        prog=prog or f"python sweeps/{kind}.py",
        **kwargs,
        description=axis.description
        or f"The {kind} ablation as a Ray Tune sweep (headless vs vanilla).",
    )
    p.add_argument("--preset", default="tiny", choices=sorted(presets), help="scale")
    p.add_argument(
        "--name",
        help=f"sweep name: runs/sweeps/<name>; the same name resumes (default {kind}-<preset>)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (optim.max_steps=20) or sweep setting (sweep.values=[512,1024])",
    )
    p.add_argument("--num-seeds", type=int, help="seeds per (value, objective)")
    p.add_argument("--workers-per-trial", type=int, help="Ray Train workers of each trial")
    p.add_argument("--cpus-per-worker", type=float, help="CPUs of each Train worker")
    p.add_argument("--gpus-per-worker", type=float, help="GPUs of each Train worker (0: CPU)")
    p.add_argument(
        "--max-failures",
        type=int,
        help="restarts of a trial's failed worker group, and retries of a failed trial",
    )
    p.add_argument(
        "--storage-path",
        help="where Tune's state, the trials' checkpoints and run folders go, under the sweep's "
        "name: an s3:// (or gs://) URI or a folder every node mounts (default: the sweep's "
        "folder, runs/sweeps/<name>)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="random search over lr and warm-up with ASHA early stopping (for one grid cell) "
        "instead of the grid",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="Ray's and Tune's output (trial tables, workers' logs) on the console; by default "
        "it goes to runs/sweeps/<name>/sweep.log and the console shows one line per trial",
    )
    from hlm_ray.plan import add_arguments

    add_arguments(p)
    return p


def sweep_items(args: argparse.Namespace) -> list[str]:
    """The `--set` items of the parsed arguments, the sweep flags (--num-seeds, ...) last."""
    flags = {
        "num_seeds": args.num_seeds,
        "workers_per_trial": args.workers_per_trial,
        "cpus_per_worker": args.cpus_per_worker,
        "gpus_per_worker": args.gpus_per_worker,
        "max_failures": args.max_failures,
    }
    return [*args.set, *(f"sweep.{k}={v}" for k, v in flags.items() if v is not None)]


def default_name(axis: Axis, args: argparse.Namespace) -> str:
    """`--name`, else <sweep>-<preset> (-search with --search): the folder runs/sweeps/<name>."""
    return args.name or f"{axis.name}-{args.preset}" + ("-search" if args.search else "")


def _with_name(argv: list[str], name: str) -> list[str]:
    """The command's arguments with --name spelled out (resuming needs the same name)."""
    if "--name" in argv or any(a.startswith("--name=") for a in argv):
        return argv
    return [*argv, "--name", name]


def _get_spec(presets: dict[str, SweepSpec], args: argparse.Namespace) -> SweepSpec:
    from hlm_ray.tune.spec import get_sweep

    return get_sweep(presets, args.preset, sweep_items(args))


def _plan(spec: SweepSpec, args: argparse.Namespace, name: str) -> str:
    """--dry-run: the trials, their steps, FLOPs and GPU-hours; nothing started."""
    from hlm_ray.plan import assumptions_from, format_plan, sweep_plan
    from hlm_ray.tune.placement import plan_concurrency

    trials = len(spec.cells())
    fit = lambda nodes: plan_concurrency(spec, trials, nodes)  # noqa: E731
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    return format_plan(sweep_plan(spec, assumptions_from(args), fit=fit, name=name, say=say))


def _run(spec: SweepSpec, args: argparse.Namespace, name: str, verbose: int = 0):
    from hlm_ray.console import say
    from hlm_ray.plan import assumptions_from
    from hlm_ray.tune.sweep import run_sweep

    if args.search:
        say(
            f"--search: random lr / warm-up samples with ASHA for objective="
            f"{spec.objectives[0]}, {spec.axis.field}={spec.values[0]} (validation losses are "
            "not comparable across objectives or vocabularies); pick the cell with "
            "--set sweep.objectives=[...] --set sweep.values=[...]"
        )
    return run_sweep(spec, name=name, search=args.search, assumptions=assumptions_from(args),
                     storage_path=args.storage_path, verbose=verbose)  # fmt: skip


def in_console(args: argparse.Namespace, name: str, run):
    """`run(verbose)` with Ray's and Tune's output in runs/sweeps/<name>/sweep.log and the
    console kept to `hlm_ray.console.say` lines (a script's parts, `sweeps/scaling.py`'s, say
    theirs there too); with --verbose, or under `ray job submit`, everything on the console."""
    from hlm_ray.console import console_to_log
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune.sweep import SWEEPS_DIR

    # Under `ray job submit` the console is the job's log, which Ray keeps and `ray job logs`
    # shows; a sweep.log would be written into the job's temporary copy of the working dir.
    if args.verbose or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return run(2)
    log = resolve_output(SWEEPS_DIR) / name / "sweep.log"
    print(f"sweep {name}: Ray's and Tune's output go to {log}", flush=True)
    from hlm_ray.train.launch import stop_own_cluster

    with console_to_log(log):
        try:
            return run(0)
        finally:
            # Ray forwards a worker's output late (a line its process flushes at exit): stopped
            # here, the cluster's last lines go to the log, not after the summary and link.
            stop_own_cluster()


def console_text(markdown: str, folder: Path) -> str:
    """A report's Markdown for the terminal: an image link (`![title](fig.png)`, for a
    Markdown viewer) becomes the figure's path and title, which a terminal can use."""
    import re

    def figure(match: re.Match) -> str:
        path = Path(match.group(2))
        shown = path if path.is_absolute() or "://" in match.group(2) else folder / path
        return f"figure: {shown}" + (f" ({match.group(1)})" if match.group(1) else "")

    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", figure, markdown)


def _print_table(outcome) -> None:
    print(f"\n== sweep {outcome.name}: {len(outcome.rows)} trial(s) in {outcome.seconds:.0f} s")
    print(outcome.table)
    if outcome.files:
        names = ", ".join(Path(p).name for p in outcome.files)
        print(
            f"\nfiles in {Path(outcome.files[0]).parent} (also on the parent MLflow run): {names}"
        )


def _print_link(outcome) -> None:
    """The last lines: how to open the sweep's parent run in MLflow's browser."""
    if getattr(outcome, "link", None):
        print("\n" + outcome.link)


def _print_outcome(outcome, search: bool) -> int:
    """The trials ASHA stopped, the best of a search; 0 when every trial finished, else 1."""
    stopped = [r for r in outcome.rows if r["status"] == "STOPPED"]
    if stopped:
        ids = ", ".join(r["trial_id"] for r in stopped)
        print(f"\n{len(stopped)} trial(s) stopped early by ASHA: {ids}")
    best = outcome.best() if search else None
    if best is not None:
        score = best.get("downstream/score")
        print(
            f"best: lr={best['lr']:.3g} warmup_steps={best['warmup_steps']} "
            f"(validation loss {best['loss']:.4f}"
            + (f", downstream score {score:.4f}" if score is not None else "")
            + f", trial {best['trial_id']})"
        )
    if outcome.failed:
        print("\n" + failure_advice(outcome.failed))
        return 1
    return 0


def failure_advice(failed: list[dict]) -> str:
    """What to do about failed trials: a diverged one diverges again (a resumed sweep keeps it
    failed, and new settings need a new --name), any other is retried by the same command."""
    from hlm_ray.errors import DIVERGED

    diverged = [r for r in failed if r.get("error", "").startswith(DIVERGED)]
    others = len(failed) - len(diverged)
    lines = []
    if diverged:
        lines.append(
            f"{len(diverged)} trial(s) diverged (their error is in the table): the same "
            "settings diverge again, and re-running this sweep keeps them failed; lower optim.lr "
            "or set optim.grad_clip with --set, under another --name (a sweep's settings are "
            "fixed by its name)"
        )
    if others:
        lines.append(
            f"{others} trial(s) did not finish (their errors are in the table and the sweep "
            "log); re-run the same command to retry them: finished trials are kept"
        )
    return "\n".join(lines)
