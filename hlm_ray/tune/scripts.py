"""`hlm sweep KIND ...`: the ablation scripts in sweeps/ run through the `hlm` command, with the
scripts' own flags (the scripts stay the way to submit a sweep as a Ray job).

    hlm sweep vocab --preset tiny --dry-run      # = python sweeps/vocab.py --preset tiny --dry-run
"""

from __future__ import annotations

from hlm_ray.errors import HLMError


def _names() -> tuple[str, ...]:
    from hlm_ray.paths import PROJECT_ROOT

    return tuple(sorted(p.stem for p in (PROJECT_ROOT / "sweeps").glob("*.py")))


SWEEPS = _names()
"""The ablations `hlm sweep` runs: every script sweeps/<name>.py (found, not named: this package
knows no axis by name), with its own flags."""


def load_script(kind: str):
    """sweeps/<kind>.py as a module (sweeps/ is beside the package, not in it). Not put in
    sys.modules, as the tests load it: Ray pickles its functions by value, as for a script."""
    import importlib.util

    from hlm_ray.paths import PROJECT_ROOT

    path = PROJECT_ROOT / "sweeps" / f"{kind}.py"
    if not path.is_file():
        raise HLMError(
            f"{path} not found: `hlm sweep` runs the scripts of the project checkout "
            "(pip install -e .); run the script itself from the checkout"
        )
    spec = importlib.util.spec_from_file_location(f"hlm_sweep_{kind}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_parser(sub, only: str | None = None) -> None:
    """`hlm sweep KIND`, a subcommand per script. `only`: the one kind this command line will
    run, whose script is loaded for its parser; the others get their help line alone, read from
    the script's docstring without running it (a script imports torch and transformers: seconds
    that `hlm train --preset typo` should not wait for). None: every script loaded."""
    sweep = sub.add_parser(
        "sweep",
        help="run an ablation sweep (a script of sweeps/: " + ", ".join(SWEEPS) + ")",
        description="Run an ablation sweep on Ray Tune: the same code and flags as "
        "`python sweeps/<name>.py` (the scripts stay the way to submit it as a Ray job).",
    )
    kinds = sweep.add_subparsers(dest="sweep", required=True, metavar="SWEEP")
    for kind in SWEEPS:
        if only is not None and kind != only:
            line = _summary_line(kind)
            kinds.add_parser(kind, help=line, description=line)
            continue
        try:
            script = load_script(kind)
        except HLMError:
            continue  # an install without the checkout's sweeps/: the command says so
        # The script's own parser (its own flags too: the headline's --curve) as the parent.
        parent = script.SCRIPT.parser(f"hlm sweep {kind}", add_help=False)
        kinds.add_parser(
            kind,
            parents=[parent],
            help=(script.__doc__ or script.AXIS.description).strip().splitlines()[0],
            description=parent.description,
        )


def _summary_line(kind: str) -> str:
    """The first line of sweeps/<kind>.py's docstring, the script not run."""
    import ast

    from hlm_ray.paths import PROJECT_ROOT

    text = (PROJECT_ROOT / "sweeps" / f"{kind}.py").read_text()
    doc = ast.get_docstring(ast.parse(text)) or f"the {kind} ablation"
    return doc.strip().splitlines()[0]


def run(args, argv: list[str]) -> int:
    """`hlm sweep KIND ...`: the script's `main` with the arguments after KIND (parsed again
    there, by the same parser)."""
    rest = argv[argv.index("sweep") + 2 :]  # `hlm` has no option that takes a value
    return load_script(args.sweep).main(rest, f"hlm sweep {args.sweep}")
