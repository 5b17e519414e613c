"""`hlm train --resume RUN`: continue a run as it was started, not with today's defaults.

The run's own config comes from the checkpoint it continues from (`config.yaml` in every
checkpoint); `--config` and `--set` may change only what a resume honours (`RESUMABLE`: the
steps, logging, checkpoints, the device; anything else is refused in one line, since the
optimizer's state and the data would carry on as saved). A changed value is recorded as a
`param_changed.*` tag, so MLflow's params keep saying what the run started with. How it was
launched (workers, CPUs, GPUs, --local, experiment) is kept in `<run>/launch.json` and used for
every flag not given again.

    cfg, launch = resumed_config(checkpoint, yaml_file=None, overrides=["optim.max_steps=300"])

A run whose checkpoints are in its run storage (`--storage-path s3://...`) is continued from
there, as `hlm train --resume s3://bucket/runs/x` or `hlm train --resume runs/x` (its storage
from its launch.json or `--storage-path`): from a head node that lost the run folder too.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hlm_ray.config import Config, apply_overrides
from hlm_ray.errors import HLMError

LAUNCH_FILE = "launch.json"
LAUNCH_DEFAULTS = {
    "local": False,
    "num_workers": 1,
    "gpu": None,
    "cpus_per_worker": 1.0,
    "max_failures": 2,
    "storage_path": None,
    "experiment": "hlm_ray",
    "placement_timeout_s": None,  # launch's own default (`placement_wait.PLACEMENT_TIMEOUT_S`)
}


RESUMABLE = (
    "optim.max_steps",  # the schedule (its decay) spans the new number of steps
    "optim.on_nonfinite",
    "optim.max_skipped_steps",
    "budget.seconds",
    "run.output_dir",
    "run.device",
    "run.log_every",
    "run.eval_every",
    "run.eval_batches",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.fail_at_step",
)
"""The settings a resume can change: each is read afresh by the resumed run. Any other (the
learning rate, betas and weight decay are in the optimizer's saved state; the batch, data and
seed decide which blocks each step sees) would be recorded but not be what ran."""


def save_launch(out_dir: str | Path, settings: dict[str, Any]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / LAUNCH_FILE).write_text(json.dumps({k: settings[k] for k in LAUNCH_DEFAULTS}, indent=1))


def discard_launch(out_dir: str | Path) -> None:
    """Undo `save_launch` for a run that failed before it wrote anything else (bad input found
    while preparing): no lone launch.json, and no folder if that was all it held."""
    from hlm_ray.train.run_lock import LOCK_FILE  # held by this process until it returns

    out = Path(out_dir)
    if out.is_dir() and {p.name for p in out.iterdir()} <= {LAUNCH_FILE, LOCK_FILE}:
        for name in (LAUNCH_FILE, LOCK_FILE):
            (out / name).unlink(missing_ok=True)
        out.rmdir()


def launch_settings(out_dir: str | Path | None, given: dict[str, Any]) -> dict[str, Any]:
    """The run's saved launch settings (none without `out_dir`), overridden by the flags given
    now (those not None)."""
    path = Path(out_dir) / LAUNCH_FILE if out_dir else None
    saved = {}
    if path and path.is_file():
        from hlm_ray.jsonl import json_file

        flags = "--local, --num-workers, --cpus-per-worker, --gpu, --experiment, --storage-path"
        saved = json_file(path, fix=f"it holds how the run was launched: delete it and give "
                                    f"the launch flags again ({flags})")  # fmt: skip
    merged = {**LAUNCH_DEFAULTS, **saved}
    merged.update({k: v for k, v in given.items() if k in LAUNCH_DEFAULTS and v is not None})
    return merged


def resumed_config(
    checkpoint: Path,
    *,
    preset: str | None = None,
    objective: str | None = None,
    yaml_file: str | None = None,
    overrides: list[str] = (),
) -> Config:
    """The config saved with `checkpoint`, then the YAML file and the dotted overrides."""
    from hlm_ray.presets import load_config

    path = Path(checkpoint) / "config.yaml"
    try:
        saved = Config.from_dict(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError, TypeError, AttributeError) as err:
        raise HLMError(f"cannot read the run's config {path}: {err}".splitlines()[0]) from None
    for flag, asked, had in (
        ("--preset", preset, saved.preset),
        ("--objective", objective, saved.objective.name),
    ):
        if asked is not None and asked != had:
            raise HLMError(
                f"{flag} {asked}: the run in {Path(checkpoint).parent} was trained with "
                f"{flag} {had}; drop {flag} to continue it, or start a new run with --output"
            )
    cfg = saved
    if yaml_file is not None:
        # load_config reads and validates the file; only what it sets is applied here.
        base = load_config(saved.preset if saved.preset != "custom" else "tiny-decoder")
        from_file = load_config(base.preset, yaml_file=yaml_file)
        changed = _diff(base.to_dict(), from_file.to_dict())
        cfg = apply_overrides(cfg, changed)
    if overrides:
        cfg = apply_overrides(cfg, list(overrides))
    check_resumable(saved, cfg, Path(checkpoint))
    return cfg


def check_resumable(saved: Config, cfg: Config, checkpoint: Path) -> None:
    """Refuse, in one line, a change a resume would record but not honour (`RESUMABLE`), and
    a max_steps that leaves the run behind its checkpoint."""
    from hlm_ray.train.checkpoint import PREFIX

    changed = _diff(saved.to_dict(), cfg.to_dict())
    budgeted = saved.budget.tokens is not None or saved.budget.flops is not None
    if budgeted and "optim.max_steps" in changed:
        raise HLMError(
            f"optim.max_steps={changed['optim.max_steps']}: the run's steps come from its "
            "budget (budget.tokens or budget.flops), which a resume keeps; resume without "
            "it, or start a new run with --output"
        )
    refused = {k: v for k, v in changed.items() if k not in RESUMABLE}
    if refused:
        key, value = next(iter(refused.items()))
        had = _dotted(saved.to_dict(), key)
        others = "".join(f", {k}={v}" for k, v in list(refused.items())[1:])
        raise HLMError(
            f"{key}={value}{others}: a resume continues the run as it was trained ({key}={had}) "
            f"and can change only {', '.join(RESUMABLE)}; train other settings as a new run "
            "with --output"
        )
    name = checkpoint.name
    step = int(name.removeprefix(PREFIX)) if name.removeprefix(PREFIX).isdecimal() else None
    if "optim.max_steps" in changed and step is not None and cfg.optim.max_steps < step:
        raise HLMError(
            f"optim.max_steps={cfg.optim.max_steps} is below step {step} of {name}, which "
            "this resume continues from; give optim.max_steps >= that step, or --resume one "
            "of the run's earlier checkpoint_* folders"
        )


def _dotted(tree: dict, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def check_compatible(cfg: Config, checkpoint: Path) -> None:
    """The model the run would build can load `checkpoint`: same architecture and vocabulary."""
    path = Path(checkpoint) / "config.yaml"
    if not path.is_file():
        return
    saved = yaml.safe_load(path.read_text()) or {}
    now = cfg.to_dict()
    for section, keys in (
        ("model", ("arch", "num_layers", "hidden_size", "num_heads")),
        ("tokenizer", ("kind", "vocab_size")),
    ):
        for key in keys:
            had = (saved.get(section) or {}).get(key)
            want = now[section].get(key)
            if had is not None and had != want:
                raise HLMError(
                    f"checkpoint {checkpoint} was trained with {section}.{key}={had}, this run "
                    f"asks for {want}; resume without --preset/--set {section}.{key} (the run's "
                    "own config is used) or start a new run with --output"
                )


def _diff(base: dict, other: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in other.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_diff(base.get(key, {}), value, f"{name}."))
        elif base.get(key) != value:
            out[name] = value
    return out


def stored_checkpoint(args) -> Path | None:
    """`hlm train --resume` of a run whose checkpoints are in its run storage, not its run
    folder (an `s3://` storage; `args.resume` a URI, or the run folder with the storage from
    `--storage-path` or its launch.json): `args.output` and `args.storage_path` are set to the
    run's, the run's MLflow id is fetched into its folder, and the result is a local folder
    named after the newest whole checkpoint in the storage, holding its config.yaml, beside
    the run's launch.json (`resumed_config`, `launch_settings`). Ray Train continues from that
    checkpoint. None: the run folder holds the checkpoints (a plain `--resume`)."""
    from hlm_ray.paths import resolve_input, resolve_output
    from hlm_ray.prepare.store import Store
    from hlm_ray.train.checkpoint import MARKER, PREFIX
    from hlm_ray.train.run_mirror import RUN_REF, RunMirror

    given = str(args.resume)
    if "://" in given:
        base, _, name = given.rstrip("/").rpartition("/")
        if name.startswith(PREFIX):
            raise HLMError(
                f"--resume {given}: pass the run, {base}, not one of its checkpoints: it "
                "continues from the newest whole one in its storage"
            )
        storage = args.storage_path or base
        output = args.output or f"runs/{name}"
    else:
        folder = resolve_input(given)
        if folder.name.startswith(PREFIX) or (folder / MARKER).is_file():
            return None  # a checkpoint folder, named
        name = folder.name
        storage = args.storage_path or launch_settings(folder, {})["storage_path"]
        output = args.output or given
    out_dir = resolve_output(output)
    mirror = RunMirror.of(out_dir, storage) if storage else None
    if mirror is None:
        return None
    if out_dir.name != name:
        raise HLMError(
            f"--output {output}: the run continued from {storage} keeps its name; leave "
            f"--output out or end it in /{name}"
        )
    store = Store.open(mirror.uri)
    whole = [n for n in store.names() if n.startswith(PREFIX) and store.exists(f"{n}/{MARKER}")]
    if not whole:
        raise HLMError(
            f"--resume {given}: {mirror.uri} holds no checkpoint of run {name}; name the "
            "storage it ran with (--storage-path), or start it again"
        )
    newest = max(whole, key=lambda n: int(n.removeprefix(PREFIX)))
    held = Path(tempfile.mkdtemp(prefix="hlm-resume-"))
    atexit.register(shutil.rmtree, held, ignore_errors=True)
    store.download(f"{newest}/config.yaml", held / newest / "config.yaml")
    store.download(LAUNCH_FILE, held / LAUNCH_FILE)
    mirror.pull(out_dir, RUN_REF)  # its MLflow run, continued
    args.output, args.storage_path = output, storage
    print(f"continuing {name} from its storage: {mirror.uri} (newest checkpoint {newest})")
    return held / newest
