"""The MLflow model registry: register a model folder as a version, download one back.

    name, version = register_model(out / "model", "hlm-tiny-generator", run_id=run_id,
                                   results={"lambada/accuracy": 0.2})
    folder = download_model("models:/hlm-tiny-generator/1")     # or models:/NAME@alias

Unlike training, registration is what the user asked for: failures raise `HLMError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hlm_ray.config import flatten
from hlm_ray.errors import HLMError, one_line
from hlm_ray.tracking import store
from hlm_ray.tracking.mlflow_tracker import MlflowTracker
from hlm_ray.tracking.store import MAX_TAG_VALUE, clip, default_tracking_uri, is_number, redact

REGISTRY_SCHEME = "models:/"
REGISTERED_ARTIFACT = "registered_model"


def register_model(
    model_dir: str | Path,
    name: str,
    *,
    run_id: str | None = None,
    experiment: str = "hlm_ray",
    tracking_uri: str | None = None,
    extra_files: Iterable[str | Path] = (),
    results: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
) -> tuple[str, int]:
    """Register the model folder as a new version of `name`; returns (name, version).

    The folder (weights, config, tokenizer) plus `extra_files` (e.g. the hlm_ray config) and
    `results` (written as ``eval_results.json``) are logged under the run's
    ``registered_model/`` artifact, and that artifact is the version's source, so
    ``download_model("models:/NAME/VERSION")`` gives back a folder `load_pretrained` reads.
    Without `run_id` a run is created to hold the artifacts. Unlike training, registration is
    what the user asked for: failures raise (HLMError) rather than being skipped."""
    import shutil
    import tempfile

    uri = tracking_uri or default_tracking_uri()
    try:
        store.probe(uri)
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            run_id = MlflowTracker(experiment, f"register-{name}", tracking_uri=uri).run_id
            if run_id is None:
                raise HLMError(f"cannot open an MLflow run at {redact(uri)} to register {name}")
            client.set_terminated(run_id, "FINISHED")
        with tempfile.TemporaryDirectory(prefix="hlm-register-") as tmp:
            folder = Path(tmp) / REGISTERED_ARTIFACT
            shutil.copytree(model_dir, folder)
            for extra in extra_files:
                shutil.copy(extra, folder / Path(extra).name)
            if results is not None:
                (folder / "eval_results.json").write_text(json.dumps(results, indent=1))
            client.log_artifacts(run_id, str(folder), REGISTERED_ARTIFACT)
        source = f"{client.get_run(run_id).info.artifact_uri}/{REGISTERED_ARTIFACT}"
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                raise
        version_tags = {k: clip(str(v), MAX_TAG_VALUE) for k, v in flatten(tags or {})}
        for key, value in flatten(results or {}):
            if is_number(value):
                version_tags[f"result.{key}"] = str(value)
        version = client.create_model_version(name, source=source, run_id=run_id, tags=version_tags)
    except HLMError:
        raise
    except Exception as err:
        raise HLMError(
            f"registering {name} at {redact(uri)} failed: {type(err).__name__}: "
            f"{one_line(err, limit=300, empty='(no message)')}"
        ) from None
    return name, int(version.version)


def download_model(uri: str, *, tracking_uri: str | None = None) -> Path:
    """A local folder with the files of ``models:/NAME/VERSION`` or ``models:/NAME@alias``.

    Versions are immutable, so each is downloaded once into the cache (an alias is resolved to
    its version first: moving the alias serves the new version)."""
    from hlm_ray.paths import cache_dir

    tracking_uri = tracking_uri or default_tracking_uri()
    name, version = parse_model_uri(uri)
    try:
        store.probe(tracking_uri)
        from mlflow import MlflowClient
        from mlflow.artifacts import download_artifacts

        client = MlflowClient(tracking_uri=tracking_uri)
        if not version.isdigit():
            version = client.get_model_version_by_alias(name, version).version
        target = cache_dir("registry", name, str(version))
        done = target / ".complete"
        if not done.exists():
            source = client.get_model_version(name, str(version)).source
            tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
            download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri)
            inner = tmp / Path(source).name  # download_artifacts keeps the folder's name
            import shutil

            shutil.rmtree(target, ignore_errors=True)
            (inner if inner.is_dir() else tmp).rename(target)
            shutil.rmtree(tmp, ignore_errors=True)
            done.touch()
    except Exception as err:
        raise HLMError(
            f"model {uri} cannot be loaded from the registry at {redact(tracking_uri)}: "
            f"{type(err).__name__}: {one_line(err, limit=300, empty='(no message)')}; list versions with "
            "`mlflow ui` or register one with `hlm finetune --task clm --register NAME`"
        ) from None
    return target


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
