"""The command line shared by the scripts in `sweeps/` (each is `sweep_main(AXIS, PRESETS, argv)`).

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
import shlex
import sys

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis
from hlm_ray.tune.spec import SweepSpec


def build_parser(
    axis: Axis, presets: dict[str, SweepSpec], prog: str | None = None, **kwargs
) -> argparse.ArgumentParser:
    """The script's parser; `prog` is how it was called (`hlm sweep vocab`), `kwargs` go to
    `ArgumentParser` (`hlm` builds its `sweep vocab` subcommand from this parser)."""
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
        "--search",
        action="store_true",
        help="random search over lr and warm-up with ASHA early stopping (for one grid cell) "
        "instead of the grid",
    )
    from hlm_ray.plan import add_arguments

    add_arguments(p)
    return p


def _with_name(argv: list[str], name: str) -> list[str]:
    """The command's arguments with --name spelled out (resuming needs the same name)."""
    if "--name" in argv or any(a.startswith("--name=") for a in argv):
        return argv
    return [*argv, "--name", name]


def sweep_main(
    axis: Axis,
    presets: dict[str, SweepSpec],
    argv: list[str] | None = None,
    prog: str | None = None,
) -> int:
    """Parse the script's arguments, run its sweep, print the table; the exit status. `prog`:
    the command that ran it (default ``python sweeps/<name>.py``), used in help and in the
    command printed to continue an interrupted sweep."""
    from hlm_ray.train.interrupt import EXIT_INTERRUPTED

    kind = axis.name
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or f"python sweeps/{kind}.py"
    args = build_parser(axis, presets, prog).parse_args(argv)
    flags = {
        "num_seeds": args.num_seeds,
        "workers_per_trial": args.workers_per_trial,
        "cpus_per_worker": args.cpus_per_worker,
        "gpus_per_worker": args.gpus_per_worker,
        "max_failures": args.max_failures,
    }
    overrides = [*args.set, *(f"sweep.{k}={v}" for k, v in flags.items() if v is not None)]
    name = args.name or f"{kind}-{args.preset}" + ("-search" if args.search else "")
    try:
        from hlm_ray.tune.spec import get_sweep
        from hlm_ray.tune.sweep import run_sweep

        spec = get_sweep(presets, args.preset, overrides)
        from hlm_ray.plan import assumptions_from, format_plan, sweep_plan

        assumptions = assumptions_from(args)
        if args.dry_run:
            from hlm_ray.tune.sweep import plan_concurrency

            trials = len(spec.cells())
            fit = lambda nodes: plan_concurrency(spec, trials, nodes)  # noqa: E731
            print(format_plan(sweep_plan(spec, assumptions, fit=fit, name=name)))
            return 0
        if args.search:
            print(
                f"--search: random lr / warm-up samples with ASHA for objective="
                f"{spec.objectives[0]}, {axis.field}={spec.values[0]} (validation losses are "
                "not comparable across objectives or vocabularies); pick the cell with "
                "--set sweep.objectives=[...] --set sweep.values=[...]"
            )
        outcome = run_sweep(spec, name=name, search=args.search, assumptions=assumptions)
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: the parent run is KILLED already
        again = " ".join([prog, *(shlex.quote(a) for a in _with_name(argv, name))])
        print(f"\ninterrupted; continue with: {again}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"\n== sweep {outcome.name}: {len(outcome.rows)} trial(s) in {outcome.seconds:.0f} s")
    print(outcome.table)
    print("\nfiles (also on the parent MLflow run):")
    for path in outcome.files:
        print(f"  {path}")
    if outcome.interrupted:
        killed = sum(r["status"] == "KILLED" for r in outcome.rows)
        again = " ".join([prog, *(shlex.quote(a) for a in _with_name(argv, name))])
        print(
            f"\ninterrupted: {killed} unfinished trial(s) stopped and marked KILLED; "
            f"continue with: {again}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    stopped = [r for r in outcome.rows if r["status"] == "STOPPED"]
    if stopped:
        ids = ", ".join(r["trial_id"] for r in stopped)
        print(f"\n{len(stopped)} trial(s) stopped early by ASHA: {ids}")
    best = outcome.best() if args.search else None
    if best is not None:
        score = best.get("downstream/score")
        print(
            f"best: lr={best['lr']:.3g} warmup_steps={best['warmup_steps']} "
            f"(validation loss {best['loss']:.4f}"
            + (f", downstream score {score:.4f}" if score is not None else "")
            + f", trial {best['trial_id']})"
        )
    if outcome.failed:
        print(f"\n{len(outcome.failed)} trial(s) did not finish; re-run the same command to retry")
        return 1
    return 0
