"""Where hlm_ray finds the shipped data and keeps its caches.

One setting each:
- ``HLM_DATA_DIR``: the offline data folder (default ``../shared/data`` next to the project root,
  i.e. relative to the directory that holds ``pyproject.toml``; a relative value is resolved
  against the current directory). On a cluster without it, every dataset falls back to its hub
  name (see `HUB_FALLBACKS`).
- ``HLM_CACHE_DIR``: trained tokenizers and tokenized corpora (default ``~/.cache/hlm_ray``).
- ``HLM_WORK_DIR``: where relative outputs (``runs/...``) and the embedded MLflow store
  (``mlflow.db``) go; default the current directory, as for ``mlflow`` and Ray (see `work_dir`).

    from hlm_ray.paths import shared_file, resolve_output
    path = shared_file("corpus/en")          # Path, or HLMError naming both places it looked
    out = resolve_output("runs/tiny")        # <current directory>/runs/tiny
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hlm_ray.errors import HLMError

DATA_ENV = "HLM_DATA_DIR"
CACHE_ENV = "HLM_CACHE_DIR"
WORK_DIR_ENV = "HLM_WORK_DIR"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The folder that holds the `hlm_ray` package: a checkout, or site-packages when installed."""
RAY_COPY_MARK = "runtime_resources"
"""A path part of the copy `ray job submit --working-dir` runs a job in (deleted after it)."""

log = logging.getLogger(__name__)
_warned_copy = False


@dataclass(frozen=True)
class HubDataset:
    """The same data on the Hugging Face hub: `datasets.load_dataset(name, config, split=split)`."""

    name: str
    config: str | None
    split: str
    text_field: str = "text"


# Each shipped file or folder and the public dataset it was taken from, for machines that reach
# the hub but do not have the offline folder. Tokenizers are hub model repositories.
HUB_FALLBACKS: dict[str, HubDataset | tuple[HubDataset, ...] | str] = {
    "corpus/en": (
        HubDataset("karpathy/tiny_shakespeare", None, "train"),
        HubDataset("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
    ),
    "eval/lambada_openai.jsonl": HubDataset("EleutherAI/lambada_openai", "default", "test"),
    "tokenizers/gpt2": "openai-community/gpt2",
    "tokenizers/gpt-neox-20b": "EleutherAI/gpt-neox-20b",
}


def project_root() -> Path:
    """The source checkout of the running package (for its git commit and shipped files).

    `ray job submit --working-dir .` runs the job from a temporary copy of the project; when the
    package is also installed from a checkout on this machine, that checkout is the project."""
    if RAY_COPY_MARK in PROJECT_ROOT.parts:
        installed = _installed_source_root()
        if installed is not None and installed.is_dir():
            return installed
    return PROJECT_ROOT


def work_dir() -> Path:
    """Where relative outputs (``runs/...``) and the embedded MLflow store go.

    ``$HLM_WORK_DIR`` if set, else the current directory, as ``mlflow`` and Ray do (never the
    package's location: installed, that is site-packages). Inside `ray job submit --working-dir
    .` the job's current directory is Ray's temporary copy of the project, deleted once the job
    ends: there the checkout the package was installed from (``pip install -e .`` or ``pip
    install .`` of a folder on this machine) is used, else the copy, with a warning saying how
    to keep the results (``HLM_WORK_DIR`` in the job's runtime environment)."""
    value = os.environ.get(WORK_DIR_ENV)
    if value:
        return Path(value).expanduser().resolve()
    cwd = Path.cwd()
    if RAY_COPY_MARK not in cwd.parts:
        return cwd
    installed = _installed_source_root()
    if installed is not None and installed.is_dir():
        return installed
    global _warned_copy
    if not _warned_copy:
        _warned_copy = True
        log.warning(
            "this job runs in Ray's temporary copy of its working dir (%s), deleted when the "
            "job ends, and hlm_ray is not installed from a folder on this machine: relative "
            "outputs and mlflow.db would be lost. Submit with --runtime-env-json "
            '\'{"env_vars": {"%s": "/where/results/go"}}\', give absolute paths, or set '
            "MLFLOW_TRACKING_URI",
            cwd,
            WORK_DIR_ENV,
        )
    return cwd


def resolve_output(path: str | Path) -> Path:
    """An output folder as an absolute path: a relative one sits in `work_dir()`."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    return (work_dir() / path).resolve()


def resolve_input(path: str | Path) -> Path:
    """A folder the user names as the input of a command (a model, a run to resume): as given,
    relative to the current directory; else, when relative and not there, inside `work_dir()`,
    where hlm's relative outputs went. Under `ray job submit --working-dir .` the two differ:
    the job runs in Ray's copy of the folder, its outputs go to the checkout, and `hlm finetune
    --model runs/x` after `hlm train --output runs/x` must find the run."""
    path = Path(path).expanduser()
    if path.exists() or path.is_absolute():
        return path
    beside_outputs = work_dir() / path
    return beside_outputs if beside_outputs.exists() else path


def data_dir() -> Path:
    """The offline data folder named by ``HLM_DATA_DIR`` (it may not exist).

    Unset, it is ``../shared/data`` beside the project. Inside `ray job submit --working-dir .`
    the package runs from Ray's copy of the project, so the folder beside the installed
    (editable) checkout is tried too."""
    value = os.environ.get(DATA_ENV)
    if value:
        return Path(value).expanduser().resolve()
    roots = [PROJECT_ROOT, _installed_source_root()]
    candidates = [(r / ".." / "shared" / "data").resolve() for r in roots if r is not None]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def _installed_source_root() -> Path | None:
    """The folder `pip install -e .` (or `pip install .`) installed hlm_ray from (PEP 610
    direct_url.json), if any; None for a wheel or a registry install."""
    import json
    import urllib.parse
    from importlib import metadata

    try:
        text = metadata.distribution("hlm_ray").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    url = json.loads(text or "{}").get("url", "")
    if not url.startswith("file://"):
        return None
    return Path(urllib.parse.unquote(url.removeprefix("file://")))


def shared_file(relative: str) -> Path:
    """`relative` inside the data folder; an `HLMError` if it is not there."""
    path = data_dir() / relative
    if not path.exists():
        fallback = HUB_FALLBACKS.get(relative)
        hint = f" or use the hub dataset {fallback!r}" if fallback else ""
        raise HLMError(
            f"{relative} not found in the data folder {data_dir()} (set {DATA_ENV} to the folder "
            f"that holds it{hint})"
        )
    return path


def has_shared(relative: str) -> bool:
    return (data_dir() / relative).exists()


def data_dir_said() -> str:
    """Where the data folder is and why, for an error about a file missing from it:
    "/x (HLM_DATA_DIR, an empty folder)", "../shared/data beside the project (HLM_DATA_DIR
    unset), which does not exist"."""
    folder = data_dir()
    why = f"{DATA_ENV}" if os.environ.get(DATA_ENV) else f"{DATA_ENV} unset: the default"
    if not folder.is_dir():
        state = "which does not exist"
    elif not any(folder.iterdir()):
        state = "an empty folder"
    else:
        state = "which does not hold it"
    return f"{folder} ({why}), {state}"


def cache_dir(*parts: str) -> Path:
    """A folder under ``HLM_CACHE_DIR`` (created)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hlm_ray").expanduser()
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_commit(folder: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` in `folder` (default: the project root); None outside a repo."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=folder or project_root(),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):  # no git binary, missing folder, hung git
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def hub_datasets(what: str):
    """The `datasets` package, for reading the hub dataset `what`; where it is not installed (a
    bare GPU node), one error line naming the package."""
    try:
        import datasets
    except ImportError:
        raise HLMError(
            f"{what} is a hub dataset: reading it needs the datasets package (pip install "
            "datasets); or pass a local file or folder"
        ) from None
    return datasets


def load_hub(what: str, name: str, config: str | None, split: str, *, streaming: bool = False):
    """`datasets.load_dataset` of a hub dataset (`what` names it in the missing-package error),
    cached under the project's cache folder unless streamed."""
    datasets = hub_datasets(what)
    if streaming:
        return datasets.load_dataset(name, config, split=split, streaming=True)
    return datasets.load_dataset(name, config, split=split, cache_dir=str(cache_dir("datasets")))


def hub_specs(source: str, text_field: str) -> tuple[HubDataset, ...]:
    """The hub datasets a source name stands for: its known fallback(s), else `name[:config]`."""
    fallback = HUB_FALLBACKS.get(source)
    if isinstance(fallback, HubDataset):
        return (fallback,)
    if isinstance(fallback, tuple):
        return fallback
    name, _, config = source.partition(":")
    return (HubDataset(name, config or None, "train", text_field),)
