"""The MLflow model registry: register a model folder as a version, download one back.

    name, version = register_model(out / "model", "hlm-tiny-generator", run_id=run_id,
                                   task="text-generation", input_example="The king said",
                                   results={"lambada/accuracy": 0.2}, alias="champion")
    folder = download_model("models:/hlm-tiny-generator/1")     # or models:/NAME@alias

A version is an MLflow *transformers-flavor* model (task, signature, input example, tokenizer,
card), so MLflow's own tools use it as they use any model:

    mlflow.pyfunc.load_model("models:/hlm-tiny-generator/1").predict(["The king said"])
    mlflow models serve -m models:/hlm-tiny-generator/1 --env-manager local

Unlike training, registration is what the user asked for: failures raise `HLMError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hlm_ray.config import flatten
from hlm_ray.errors import HLMError, one_line
from hlm_ray.model_card import CARD_FILE
from hlm_ray.tracking import store
from hlm_ray.tracking.mlflow_tracker import MlflowTracker
from hlm_ray.tracking.store import (
    MAX_TAG_VALUE,
    absolute_uri,
    clip,
    default_tracking_uri,
    is_number,
    redact,
)

REGISTRY_SCHEME = "models:/"
FLAVOR_SUBDIR = "model"  # where the transformers flavor keeps the weights (save_pretrained)
TASKS = ("text-generation", "text-classification")
DEFAULT_EXAMPLE = "The old man looked at the sea and said"
# Files of an hlm model folder that the flavor's save_pretrained does not write: they are added
# to its model/ folder so that hlm's loaders read a registered model like a run's model folder.
_KEEP = ("config.json", "model.safetensors", "generation_config.json")


def _signature(task: str, pair: bool):
    """The model's inputs and outputs as MLflow records them (and checks at serving time)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    if task == "text-generation":
        return ModelSignature(
            inputs=Schema([ColSpec(DataType.string)]),
            outputs=Schema([ColSpec(DataType.string)]),
            params=ParamSchema(
                [
                    ParamSpec("max_new_tokens", DataType.long, 32),
                    ParamSpec("do_sample", DataType.boolean, False),
                    ParamSpec("temperature", DataType.double, 1.0),
                ]
            ),
        )
    inputs = (
        [ColSpec(DataType.string, "text"), ColSpec(DataType.string, "text_pair")]
        if pair
        else [ColSpec(DataType.string)]
    )
    return ModelSignature(
        inputs=Schema(inputs),
        outputs=Schema([ColSpec(DataType.string, "label"), ColSpec(DataType.double, "score")]),
    )


def _requirements() -> list[str]:
    """Pinned to this environment (MLflow's default would also demand torchvision)."""
    from importlib.metadata import version

    return [
        f"{name}=={version(name).split('+')[0]}" for name in ("torch", "transformers", "tokenizers")
    ]


def _log_flavor(folder: Path, task: str, input_example: Any, card: Path | None):
    """Log the model folder through mlflow.transformers into the active run; its ModelInfo."""
    import mlflow
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForCausalLM if task == "text-generation" else AutoModelForSequenceClassification
    model = cls.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model_card = None
    if card is not None and card.is_file():
        from huggingface_hub import ModelCard

        model_card = ModelCard(card.read_text())  # else MLflow asks the hub for one
    pair = isinstance(input_example, dict)
    return mlflow.transformers.log_model(
        {"model": model, "tokenizer": tokenizer},
        name=FLAVOR_SUBDIR,
        task=task,
        signature=_signature(task, pair),
        input_example=input_example,
        pip_requirements=_requirements(),
        model_card=model_card,
        model_config={"max_new_tokens": 32} if task == "text-generation" else None,
    )


def register_model(
    model_dir: str | Path,
    name: str,
    *,
    task: str = "text-generation",
    input_example: Any = None,
    run_id: str | None = None,
    experiment: str = "hlm_ray",
    tracking_uri: str | None = None,
    extra_files: Iterable[str | Path] = (),
    results: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
    alias: str | None = None,
) -> tuple[str, int]:
    """Register the model folder as a new version of `name` through MLflow's transformers
    flavor; returns (name, version).

    `task` is the pipeline it serves (``text-generation`` or ``text-classification``);
    `input_example` a prompt (a string, or ``{"text": a, "text_pair": b}`` for a pair task;
    default: a fixed sentence).
    The logged model has a signature, the example, the tokenizer and config, and the folder's
    README.md as its card, so ``mlflow.pyfunc.load_model("models:/NAME/VERSION")``,
    ``mlflow.transformers.load_model`` and ``mlflow models serve`` work on it. The folder's
    other files (tokenizer, `extra_files` such as the hlm_ray config, `results` written as
    ``eval_results.json``) are added to the flavor's ``model/`` folder, which
    `download_model` returns to hlm's loaders. Numeric `results` become metrics of the logged
    model (and of the run) and ``result.*`` tags of the version; `tags` are version tags;
    `alias` points ``models:/NAME@alias`` at the new version. Without `run_id` a run is created
    to hold the model. Unlike training, registration is what the user asked for: failures raise
    (HLMError) rather than being skipped."""
    import shutil
    import tempfile

    if task not in TASKS:
        raise HLMError(f"task={task!r} cannot be registered; use one of {', '.join(TASKS)}")
    _check_model_dir(Path(model_dir), extra_files)
    if input_example is None:
        input_example = DEFAULT_EXAMPLE
    uri = tracking_uri or default_tracking_uri()
    opened: MlflowTracker | None = None  # the run made here to hold the model, if any
    try:
        store.probe(uri)
        import mlflow
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            opened = MlflowTracker(experiment, f"register-{name}", tracking_uri=uri)
            run_id = opened.run_id
            if run_id is None:
                raise HLMError(f"cannot open an MLflow run at {redact(uri)} to register {name}")
        metrics = {k: float(v) for k, v in flatten(results or {}) if is_number(v)}
        with tempfile.TemporaryDirectory(prefix="hlm-register-") as tmp, _tracking_uri(uri):
            extras = Path(tmp) / FLAVOR_SUBDIR
            shutil.copytree(model_dir, extras, ignore=shutil.ignore_patterns(*_KEEP))
            for extra in extra_files:
                shutil.copy(extra, extras / Path(extra).name)
            if results is not None:
                (extras / "eval_results.json").write_text(json.dumps(results, indent=1))
            with mlflow.start_run(run_id=run_id):
                info = _log_flavor(Path(model_dir), task, input_example, extras / CARD_FILE)
                client.log_model_artifacts(info.model_id, str(extras), FLAVOR_SUBDIR)
                if metrics:
                    mlflow.log_metrics(metrics, model_id=info.model_id)
            version_tags = {k: clip(str(v), MAX_TAG_VALUE) for k, v in flatten(tags or {})}
            version_tags |= {f"result.{k}": str(v) for k, v in metrics.items()}
            version_tags["hlm.task"] = task
            version = mlflow.register_model(info.model_uri, name, tags=version_tags)
        if alias:
            client.set_registered_model_alias(name, alias, version.version)
    except BaseException as err:
        if opened is not None:  # a run left RUNNING would say registration is still going on
            opened.finish("FAILED" if isinstance(err, Exception) else "KILLED")
        if isinstance(err, HLMError) or not isinstance(err, Exception):
            raise
        raise HLMError(
            f"registering {name} at {redact(uri)} failed: {type(err).__name__}: "
            f"{one_line(err, limit=300, empty='(no message)')}"
        ) from None
    if opened is not None:
        opened.finish("FINISHED")
    return name, int(version.version)


def _check_model_dir(model_dir: Path, extra_files: Iterable[str | Path]) -> None:
    """A model folder (config.json and weights, as `save_pretrained` writes) and extra files
    that exist, checked before any MLflow run is opened."""
    if not model_dir.is_dir():
        what = "is a file" if model_dir.exists() else "does not exist"
        raise HLMError(
            f"model folder {model_dir} {what}; pass the model/ folder of a fine-tuned run "
            "(e.g. runs/<name>/model, as `hlm finetune` prints)"
        )
    if not (model_dir / "config.json").is_file():
        raise HLMError(
            f"{model_dir} holds no config.json: not a saved model folder; pass the model/ "
            "folder of a fine-tuned run"
        )
    for extra in extra_files:
        if not Path(extra).is_file():
            raise HLMError(f"extra file {extra} does not exist")


@contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (log_model needs it) pointed at `uri`, then back, environment
    included (setting the URI writes MLFLOW_TRACKING_URI; restoring None would delete it)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    env = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env


def download_model(uri: str, *, tracking_uri: str | None = None) -> Path:
    """The local model folder (config.json, weights, tokenizer, extra files) of
    ``models:/NAME/VERSION`` or ``models:/NAME@alias``: the ``model/`` folder of a
    transformers-flavor version, the whole artifact of one registered as a plain folder.

    Versions are immutable, so each is downloaded once into the cache (an alias is resolved to
    its version first: moving the alias serves the new version). The cache is keyed by the
    store and the version's identity (its run, source and creation time), not by NAME/VERSION
    alone: another store, or a store made again after its mlflow.db was deleted, has its own
    version 1 of the same name."""
    from hlm_ray.paths import cache_dir

    tracking_uri = absolute_uri(tracking_uri or default_tracking_uri())
    name, version = parse_model_uri(uri)
    try:
        store.probe(tracking_uri)
        store.bound_http_waits()  # artifacts through the tracking server (`store.HTTP_WAITS`)
        from mlflow import MlflowClient
        from mlflow.artifacts import download_artifacts

        client = MlflowClient(tracking_uri=tracking_uri)
        if not version.isdigit():
            version = client.get_model_version_by_alias(name, version).version
        found = client.get_model_version(name, str(version))
        target = cache_dir("registry", name, f"{version}-{version_key(tracking_uri, found)}")
        done = target / ".complete"
        if not done.exists():
            source = found.source
            tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
            download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri)
            inner = tmp / Path(source).name  # download_artifacts keeps the folder's name
            import shutil

            shutil.rmtree(target, ignore_errors=True)
            (inner if inner.is_dir() else tmp).rename(target)
            shutil.rmtree(tmp, ignore_errors=True)
            _complete_flavor_folder(target)
            done.touch()
    except Exception as err:
        raise HLMError(
            f"model {uri} cannot be loaded from the registry at {redact(tracking_uri)}: "
            f"{type(err).__name__}: {one_line(err, limit=300, empty='(no message)')}; list versions with "
            "`mlflow ui` or register one with `hlm finetune --task clm --register NAME`"
        ) from None
    return target / FLAVOR_SUBDIR if (target / "MLmodel").is_file() else target


def version_key(tracking_uri: str, version: Any) -> str:
    """What tells a registered version apart from every other one under the same NAME/VERSION
    (16 hex digits): the store's URI, and the version's run, source and creation time (a new
    store, or one made again, gives its version 1 a new run and a new logged-model source)."""
    import hashlib

    identity = [
        tracking_uri,
        version.name,
        str(version.version),
        version.run_id or "",
        version.source or "",
        str(version.creation_timestamp or ""),
    ]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


def _complete_flavor_folder(target: Path) -> None:
    """A transformers-flavor model keeps its tokenizer under components/tokenizer/; copy it
    beside the weights (a version logged by hlm has it there already, one logged by other code
    may not), so that the model/ folder is what hlm's loaders read."""
    import shutil

    weights, tokenizer = target / FLAVOR_SUBDIR, target / "components" / "tokenizer"
    if not (target / "MLmodel").is_file() or not tokenizer.is_dir():
        return
    for path in tokenizer.iterdir():
        if path.is_file() and not (weights / path.name).exists():
            shutil.copy(path, weights / path.name)


def parse_model_uri(uri: str) -> tuple[str, str]:
    """("NAME", "VERSION" or "alias") from models:/NAME/VERSION or models:/NAME@alias."""
    rest = uri.removeprefix(REGISTRY_SCHEME)
    if "@" in rest:
        name, _, ref = rest.partition("@")
    else:
        name, _, ref = rest.partition("/")
    if not uri.startswith(REGISTRY_SCHEME) or not name or not ref or "/" in ref:
        raise HLMError(
            f"{uri!r} is not a registry URI: use models:/NAME/VERSION or models:/NAME@alias"
        )
    return name, ref
