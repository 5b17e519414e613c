"""lm-evaluation-harness tasks on an hlm model: ``hlm eval --task harness:lambada_openai,sst2``.

    from hlm_ray.evaluate.harness import run_harness
    out = run_harness(pre.model, pre.tokenizer, ["lambada_openai"], max_length=128,
                      output_dir=Path("runs/x/eval"), limit=50)
    out["metrics"]["harness/lambada_openai/perplexity"]

The model runs through the harness's own `HFLM` wrapper and `lm_eval.simple_evaluate`, scored at
the length it was trained on (`max_length`, see evaluate/common.py). The harness's tasks load hub
datasets; offline, a task whose data ship in ``$HLM_DATA_DIR/eval`` (`OFFLINE_TASKS`) runs from
that file: a task YAML is written to ``<output_dir>/harness_tasks/<task>.yaml`` that ``include``s
the harness's own YAML (same prompt, metrics and aggregation) and only points its dataset at the
local file (and, for LAMBADA, reads the file's ``context``/``continuation`` fields, which are the
hub ``text`` split at its last space, exactly as the harness's doc_to_text/doc_to_target split
it). Any other task is the harness's, by name; when its data cannot be loaded, the error names
the task and what is missing.

`hlm eval --task lambada` and ``harness:lambada_openai`` score the same passages with the same
encoding and truncation (see evaluate/lambada.py), so their perplexities agree.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hlm_ray.errors import HLMError
from hlm_ray.paths import DATA_ENV, data_dir, has_shared, shared_file

PREFIX = "harness:"
"""`hlm eval --task` items from this prefix on are harness tasks."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineTask:
    """A harness task whose split ships in the data folder.

    `yaml`: the harness's task YAML, relative to ``lm_eval/tasks``; `file`: the shipped file,
    relative to the data folder; `split`: the split the task scores; `fields`: YAML keys that
    replace the harness's (a file whose columns differ from the hub's)."""

    yaml: str
    file: str
    split: str
    builder: str  # the `datasets` builder that reads `file`: json | csv
    fields: dict[str, Any] = field(default_factory=dict)


OFFLINE_TASKS: dict[str, OfflineTask] = {
    "lambada_openai": OfflineTask(
        "lambada/lambada_openai.yaml",
        "eval/lambada_openai.jsonl",
        "test",
        "json",
        {"doc_to_text": "{{context}}", "doc_to_target": "{{' '+continuation}}"},
    ),
    # GLUE dev TSV: `sentence<TAB>label`, the hub's columns; no quoting (csv.QUOTE_NONE = 3).
    "sst2": OfflineTask(
        "glue/sst2/default.yaml",
        "eval/glue/sst2/dev.tsv",
        "validation",
        "csv",
        {"training_split": None},
    ),
}


def split_tasks(text: str) -> list[str]:
    """`hlm eval --task` as a list: ``"lambada,harness:lambada_openai,sst2"`` ->
    ``["lambada", "harness:lambada_openai,sst2"]`` (the harness item takes the rest)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    for i, item in enumerate(items):
        if item.startswith(PREFIX):
            return items[:i] + [",".join(items[i:])]
    return items


TASKS = ("lambada", "bpb", "synonyms", "anisotropy")
"""The built-in tasks (`report.EVAL_TASKS`, whose modules import torch: named here so that a
mistyped --task is answered before that import; a test keeps the two equal)."""


def check_tasks(tasks: list[str]) -> None:
    """Each of `tasks` (`split_tasks`'s) is a built-in task or a harness item."""
    for name in tasks:
        if not name.startswith(PREFIX) and name not in TASKS:
            raise HLMError(
                f"unknown evaluation task {name!r}; the tasks are {', '.join(TASKS)}, "
                "and harness:<lm-eval task>[,...]"
            )


def require_harness(tasks: list[str]) -> None:
    """One line naming the extra when `tasks` (`split_tasks`'s) ask for the harness and it is
    not installed, before a model is resolved or a run opened."""
    import importlib.util

    if any(t.startswith(PREFIX) for t in tasks) and importlib.util.find_spec("lm_eval") is None:
        raise HLMError(
            "harness: tasks need lm-evaluation-harness, which is not installed: "
            "pip install -e '.[eval]' (or pip install 'hlm_ray[eval]')"
        )


def harness_names(item: str) -> list[str]:
    """The harness task names of one ``harness:a,b`` item."""
    names = [n.strip() for n in item.removeprefix(PREFIX).split(",") if n.strip()]
    if not names:
        raise HLMError(
            f"{item!r} names no harness task; write harness:<task>[,<task>...], "
            "e.g. harness:lambada_openai"
        )
    return names


def offline_yaml(name: str, output_dir: Path) -> Path | None:
    """Write the offline YAML of `name` (None when it has none or its file is not shipped)."""
    task = OFFLINE_TASKS.get(name)
    if task is None or not has_shared(task.file):
        return None
    import lm_eval

    builtin = Path(lm_eval.__file__).parent / "tasks" / task.yaml
    kwargs: dict[str, Any] = {"data_files": {task.split: str(shared_file(task.file))}}
    if task.builder == "csv":
        kwargs.update(delimiter="\t", quoting=3)
    cfg = {
        "include": str(builtin),
        "task": name,
        "dataset_path": task.builder,
        "dataset_name": None,
        "dataset_kwargs": kwargs,
        **task.fields,
    }
    folder = output_dir / "harness_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def task_manager(names: list[str], output_dir: Path):
    """A `TaskManager` that knows the offline YAMLs of `names`, and the names it runs offline."""
    offline = {n: offline_yaml(n, output_dir) for n in names}
    offline = {n: path for n, path in offline.items() if path is not None}
    for stale in (output_dir / "harness_tasks").glob("*.yaml"):  # an earlier run's tasks
        if stale not in offline.values():
            stale.unlink()
    # Indexing the harness's ~10k YAMLs takes seconds: one index per set of offline YAMLs.
    manager = _manager(tuple(sorted((str(p), p.read_text()) for p in offline.values())))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise HLMError(
            f"{', '.join(unknown)}: not an lm-evaluation-harness task or group "
            "(`lm-eval ls tasks` lists them)"
        )
    return manager, list(offline)


@functools.lru_cache(maxsize=4)
def _manager(yamls: tuple[tuple[str, str], ...]):
    """A `TaskManager` over the harness's tasks and the offline YAMLs `yamls` ((path, text)
    pairs: the text is in the key so that a rewritten YAML is indexed again)."""
    from lm_eval.tasks import TaskManager

    include = [str(Path(path).parent) for path, _ in yamls][:1] or None
    return TaskManager(include_path=include, verbosity="ERROR")


def _check_data(names: list[str], manager, offline: list[str]) -> None:
    """Build each task (this loads its data) so that missing data fails with a clear message
    before the model runs."""
    from lm_eval.tasks import get_task_dict

    for name in names:
        try:
            get_task_dict([name], manager)
        except Exception as err:  # offline: ConnectionError, DatasetNotFoundError, OSError, ...
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HLMError(_missing_message(name, manager, offline, first)) from None


def _missing_message(name: str, manager, offline: list[str], reason: str) -> str:
    if name in offline:
        return f"harness task {name}: its local data could not be read ({reason})"
    hub = manager.task_index[name].cfg.get("dataset_path") if name in manager.task_index else None
    what = f"the hub dataset {hub}" if hub else "its data"
    known = OFFLINE_TASKS.get(name)
    here = (
        f"{known.file} is not in the data folder {data_dir()} (set {DATA_ENV}) and "
        if known
        else f"it has no offline copy (offline: {', '.join(OFFLINE_TASKS)}) and "
    )
    return f"harness task {name}: {here}{what} could not be loaded ({reason})"


def run_harness(
    model,
    tokenizer,
    names: list[str],
    *,
    max_length: int,
    output_dir: Path,
    batch_size: int = 32,
    limit: int | None = None,
    bootstrap_iters: int = 0,
) -> dict[str, Any]:
    """Run harness tasks `names` on a loaded causal LM (inputs at most `max_length` tokens, the
    first `limit` documents of each task). `bootstrap_iters` > 0 adds the harness's bootstrap
    standard errors (slow: a process pool). Returns ``{"metrics": {"harness/<task>/<metric>":
    value}, "harness_results": the harness's per-task results, "offline": [tasks]}``."""
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    if limit is not None and limit <= 0:
        raise HLMError(f"limit={limit} must be a positive number of documents (or None for all)")
    manager, offline = task_manager(names, output_dir)
    _check_data(names, manager, offline)
    # A loaded model: the harness scores exactly the weights `hlm eval` loaded. Log-softmax in
    # float32 as evaluate/lambada.py does (the harness's default is the model's dtype).
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        max_length=max_length,
        batch_size=batch_size,
        softmax_dtype=torch.float32,
    )
    truncated = _CountTruncations()
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    hf_log.addFilter(truncated)
    try:
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
            verbosity="WARNING",
        )
    finally:
        hf_log.removeFilter(truncated)
    if truncated.count:
        log.warning(
            "harness: %d request(s) left-truncated to the last %d tokens (the trained context "
            "length; the continuation is always kept)",
            truncated.count,
            max_length,
        )
    results = out["results"]
    metrics: dict[str, float] = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not isinstance(value, int | float) or isinstance(value, bool) or metric in _SKIP:
                continue  # "alias", "N/A" standard errors, the document count twice
            suffix = metric if filt in ("none", "") else f"{metric}_{filt}"
            if math.isfinite(value):
                metrics[f"harness/{task}/{suffix}"] = float(value)
        samples = out.get("n-samples", {}).get(task)
        if samples:
            metrics[f"harness/{task}/num_examples"] = samples["effective"]
    return {"metrics": metrics, "harness_results": results, "offline": offline}


_SKIP = {"sample_len"}  # the same as n-samples' "effective" (num_examples)


class _CountTruncations(logging.Filter):
    """Counts HFLM's one-warning-per-request "Truncating ... from the left" and drops them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "Truncating" in record.getMessage():
            self.count += 1
            return False
        return True


def harness_task(item: str) -> tuple[str, str, Callable[..., dict]]:
    """(name, description, function) of the `EvalTask` `hlm eval` runs for one ``harness:a,b``
    item (evaluate/report.py builds it; the function is called like the other tasks')."""
    from hlm_ray.evaluate.common import CONTEXT_METRIC, context_length_of

    names = harness_names(item)

    def run(pre, *, output_dir, limit, batch_size, device, progress) -> dict:
        length, source = context_length_of(
            pre.run_config, getattr(pre.model, "config", None), str(pre.source)
        )
        out = run_harness(
            pre.model,
            pre.tokenizer,
            names,
            max_length=length,
            output_dir=output_dir,
            batch_size=batch_size,
            limit=limit,
        )
        return {
            "metrics": {**out["metrics"], CONTEXT_METRIC: length},
            "context_length_source": source,
            "harness_tasks": names,
            "offline": out["offline"],
            "harness_results": out["harness_results"],
            "protocol": f"lm-evaluation-harness {_version()} HFLM, 0-shot",
        }

    return "harness-" + "-".join(names), f"lm-evaluation-harness: {', '.join(names)}", run


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
