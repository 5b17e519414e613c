"""`hlm bench`: the benchmarks from the command line (wired into `hlm` by `add_parser`/`run`).

    hlm bench --preset cpu                         # < 10 min on 2 cores -> runs/bench/cpu
    hlm bench --preset gpu --mlflow                # one CUDA device; also logged to MLflow
    hlm bench --preset cpu --only train_step --repeats 7
    hlm bench --only serve                         # serving: overhead ratio and soak (serve.py)
    hlm bench --only serve-engines                 # in-house engine vs vLLM (serve_engines.py)
    python -m hlm_ray.bench --preset smoke --output /tmp/bench
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m hlm_ray.bench --preset cpu

In `hlm_ray/cli.py`:

    from hlm_ray.bench import cli as bench_cli
    bench_cli.add_parser(sub)                      # sub = parser.add_subparsers(...)
    handler["bench"] = bench_cli.run
"""

from __future__ import annotations

import argparse
import sys

from hlm_ray.errors import exit_status

HELP = "benchmark headless vs vanilla: loss head, training step, Ray overhead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hlm_ray.bench.presets import BENCH_PRESETS, BENCHMARKS  # not suite's torch: a parser

    p.add_argument(
        "--preset",
        choices=list(BENCH_PRESETS),
        default="cpu",
        help="smoke (seconds), cpu (2 cores, < 10 min), gpu (one CUDA device, bf16)",
    )
    p.add_argument("--output", help="folder for CSV, Markdown and figures (runs/bench/<preset>)")
    p.add_argument(
        "--only",
        help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all), or serve "
        "(the serving benchmark on its own: python -m hlm_ray.bench.serve --help), or "
        "serve-engines (the in-house engine against vLLM, side by side: python -m "
        "hlm_ray.bench.serve_engines --help)",
    )
    p.add_argument("--repeats", type=int, help="timed repeats per measurement (preset's default)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto (default): the GPU when this process sees one, else the CPU",
    )
    p.add_argument("--mlflow", action="store_true", help="log the results as one MLflow run")
    p.add_argument("--experiment", default="hlm_bench", help="MLflow experiment (with --mlflow)")
    p.add_argument("--headline", help="also copy the headline figure here, e.g. docs/figures/x.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help=HELP, description=HELP)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:

    from hlm_ray.bench.presets import get_bench_preset
    from hlm_ray.bench.suite import log_to_mlflow, parse_only, run_bench
    from hlm_ray.device import resolve_device
    from hlm_ray.paths import resolve_output

    if args.only == "serve":
        from hlm_ray.bench import serve as serve_bench

        return serve_bench.main(["--output", args.output or "runs/bench/serve"])
    if args.only == "serve-engines":
        from hlm_ray.bench import serve_engines

        return serve_engines.main(["--output", args.output or "runs/bench/serve-engines"])
    preset = get_bench_preset(args.preset, repeats=args.repeats)
    only = parse_only(args.only)
    device = resolve_device(args.device, option="--device")
    out = resolve_output(args.output or f"runs/bench/{preset.name}")
    headline = resolve_output(args.headline) if args.headline else None
    progress = not args.no_progress and sys.stderr.isatty()
    result = run_bench(
        preset, output_dir=out, only=only, device=device, progress=progress, headline=headline
    )
    print()
    print(result.markdown)
    print(f"wrote {len(result.files)} files to {out}")
    for name, error in result.failures.items():
        print(f"error: benchmark {name} failed: {error}", file=sys.stderr)
    if args.mlflow:
        run_id = log_to_mlflow(result, args.experiment)
        print(f"MLflow run {run_id} (experiment {args.experiment})" if run_id else
              "MLflow logging failed: see the warning above")  # fmt: skip
    return 1 if result.failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlm_ray.bench", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return exit_status(lambda: run(args))


__all__ = ["add_arguments", "add_parser", "main", "run"]
