"""The classification tasks (GLUE, XNLI) and where their examples come from.

    from hlm_ray.classify.tasks import TASKS, load_task
    data = load_task("glue:sst2")                  # TaskData(train, eval={"eval": [...]}, ...)
    data = load_task("xnli:en", eval_languages="all")   # eval={"ar": [...], ..., "zh": [...]}
    data = load_task("glue:stsb", train_file="train.tsv", eval_file="dev.tsv")
    data.source, data.note                         # "shared-dev-split", "a split of the dev file..."

Where the examples come from, first match wins:
1. ``train_file`` and ``eval_file`` (source "files"); only one of them: a split of it
   ("file-split", same rule as 2).
2. The offline data folder (`hlm_ray.paths.data_dir`, source "shared-dev-split"). It holds only
   the GLUE/XNLI **dev** files, so each is split deterministically:
   ``perm = numpy.random.default_rng(split_seed).permutation(n)``; rows ``perm[:round(eval_fraction
   * n)]`` evaluate and the rest train. Such a score is NOT a GLUE/XNLI dev score: never report it
   as one. The XNLI files are row-aligned translations, so every language uses the SAME row
   indices: an evaluation row in one language is never a training row in another, which keeps
   the zero-shot (train English, evaluate all) protocol honest.
3. The hub (source "hub"): ``nyu-mll/glue`` (config = the task, splits train / validation) and
   ``facebook/xnli`` (config = the language).

XNLI protocols: ``xnli:en`` with ``eval_languages="all"`` trains on English and evaluates every
language (zero-shot cross-lingual transfer); ``xnli:fr`` alone trains and evaluates on French
(fine-tuning per target language).

File formats (TSV read with ``csv.QUOTE_NONE``: GLUE sentences contain bare quotes): a TSV whose
first line names the columns (the task's field names, or GLUE's own: MRPC ``#1 String``,
``#2 String``, ``Quality``; STS-B ``score``), the headerless GLUE/XNLI layouts of CoLA
(``source, label, orig_label, sentence``) and XNLI (``premise, hypothesis, label``), or JSON lines
with the field names. Labels are the class names (``entailment``) or their ids.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hlm_ray.errors import HLMError
from hlm_ray.jsonl import json_objects
from hlm_ray.paths import DATA_ENV, data_dir, has_shared, load_hub

XNLI_LANGUAGES = ("ar", "de", "en", "es", "fr", "hi", "zh")  # the paper's seven
GLUE_EVAL = "eval"  # the eval-split key of single-split tasks


@dataclass(frozen=True)
class Example:
    text_a: str
    text_b: str | None  # None for single-sentence tasks
    label: int | float  # class id, or a score for regression (STS-B)


@dataclass(frozen=True)
class TaskSpec:
    name: str  # "glue:sst2", "xnli:fr"
    text_fields: tuple[str, ...]  # one (single sentence) or two (a pair), hub field names
    label_names: tuple[str, ...]  # class names in id order; () for regression
    metrics: tuple[str, ...]  # what `metrics.task_metrics` reports
    main_metric: str  # picks the best epoch
    hub_name: str
    hub_config: str
    shared_path: str | None = None  # the dev file in the data folder, if one is shipped
    headerless: tuple[str, ...] | None = None  # column names of a file without a header row
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # other column names
    language: str | None = None  # XNLI only

    @property
    def regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        return len(self.label_names) or 1

    @property
    def is_pair(self) -> bool:
        return len(self.text_fields) == 2


@dataclass
class TaskData:
    task: TaskSpec
    train: list[Example]
    eval: dict[str, list[Example]]  # "eval" (GLUE) or language code (XNLI) -> examples
    source: str  # "shared-dev-split" | "hub" | "files" | "file-split"
    note: str  # what the split is, in words (goes into every result file)


def _glue(config: str, text: tuple[str, ...], labels: tuple[str, ...], metrics, **kw) -> TaskSpec:
    return TaskSpec(
        name=f"glue:{config}",
        text_fields=text,
        label_names=labels,
        metrics=metrics,
        main_metric=metrics[0],
        hub_name="nyu-mll/glue",
        hub_config=config,
        **kw,
    )


def _xnli(lang: str) -> TaskSpec:
    return TaskSpec(
        name=f"xnli:{lang}",
        text_fields=("premise", "hypothesis"),
        # The hub's (and HF's) order: entailment=0, neutral=1, contradiction=2.
        label_names=("entailment", "neutral", "contradiction"),
        metrics=("accuracy",),
        main_metric="accuracy",
        hub_name="facebook/xnli",
        hub_config=lang,
        shared_path=f"eval/xnli/dev-{lang}.tsv",
        headerless=("premise", "hypothesis", "label"),
        language=lang,
    )


_PAIR = ("sentence1", "sentence2")
_ENTAIL = ("entailment", "not_entailment")
# The first metric picks the best epoch: MCC for CoLA (accuracy is reported alongside), accuracy
# for MRPC as in the authors' GLUE code (F1 reported), Spearman for STS-B.
TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _glue("sst2", ("sentence",), ("negative", "positive"), ("accuracy",),
              shared_path="eval/glue/sst2/dev.tsv"),
        _glue("cola", ("sentence",), ("unacceptable", "acceptable"), ("mcc", "accuracy"),
              shared_path="eval/glue/cola/dev.tsv",
              headerless=("source", "label", "orig_label", "sentence")),
        _glue("mrpc", _PAIR, ("not_equivalent", "equivalent"), ("accuracy", "f1"),
              shared_path="eval/glue/mrpc/dev.tsv",
              aliases={"sentence1": ("#1 String",), "sentence2": ("#2 String",),
                       "label": ("Quality",)}),
        _glue("rte", _PAIR, _ENTAIL, ("accuracy",), shared_path="eval/glue/rte/dev.jsonl",
              aliases={"sentence1": ("premise",), "sentence2": ("hypothesis",)}),
        _glue("qnli", ("question", "sentence"), _ENTAIL, ("accuracy",),
              shared_path="eval/glue/qnli/dev.tsv"),
        # Regression; no STS-B file is shipped: the user passes files (or the hub provides it).
        _glue("stsb", _PAIR, (), ("spearman", "pearson"), aliases={"label": ("score",)}),
        *(_xnli(lang) for lang in XNLI_LANGUAGES),
    )
}  # fmt: skip


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise HLMError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    return TASKS[name]


# ----------------------------------------------------------------------------- reading files


def _parse_label(value: Any, spec: TaskSpec, where: str) -> int | float:
    text = str(value).strip()
    if spec.regression:
        try:
            return float(text)
        except ValueError:
            raise HLMError(f"{where}: label {text!r} is not a number") from None
    if text in spec.label_names:
        return spec.label_names.index(text)
    if text.lstrip("-").isdigit() and 0 <= int(text) < spec.num_labels:
        return int(text)
    allowed = ", ".join([*spec.label_names, *map(str, range(spec.num_labels))])
    raise HLMError(f"{where}: label {text!r} of {spec.name} is not one of {allowed}")


def _example(fields: dict[str, Any], spec: TaskSpec, where: str) -> Example:
    """An Example from one record whose keys are the canonical field names."""
    texts = [str(fields[name]) for name in spec.text_fields]
    label = _parse_label(fields["label"], spec, where)
    return Example(texts[0], texts[1] if spec.is_pair else None, label)


def _needed(spec: TaskSpec) -> tuple[str, ...]:
    return (*spec.text_fields, "label")


def _column_of(names: Sequence[str], wanted: str, spec: TaskSpec) -> int | None:
    for candidate in (wanted, *spec.aliases.get(wanted, ())):
        if candidate in names:
            return names.index(candidate)
    return None


def _header_columns(first: list[str], spec: TaskSpec, path: Path) -> dict[str, int] | None:
    """{field: column} when the first row is a header, None when it is data."""
    names = [c.strip() for c in first]
    found = {f: _column_of(names, f, spec) for f in _needed(spec)}
    if all(i is None for i in found.values()):
        return None
    missing = [f for f, i in found.items() if i is None]
    if missing:
        raise HLMError(
            f"{path}, line 1: the header has no {missing[0]!r} column (columns: "
            f"{', '.join(names)}); {spec.name} needs {', '.join(_needed(spec))}"
        )
    return found  # type: ignore[return-value]


def _read_tsv(path: Path, spec: TaskSpec) -> Iterator[Example]:
    # utf-8-sig drops MRPC's byte-order mark; QUOTE_NONE keeps GLUE's bare quotes as text.
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        columns: dict[str, int] | None = None
        for row in reader:
            line = reader.line_num
            if not row:  # a blank line
                continue
            if columns is None:
                columns = _header_columns(row, spec, path)
                if columns is not None:
                    continue
                if spec.headerless is None:
                    raise HLMError(
                        f"{path}, line 1: no header row; the first line must name the columns "
                        f"{', '.join(_needed(spec))} (tab-separated)"
                    )
                columns = {f: spec.headerless.index(f) for f in _needed(spec)}
            where = f"{path}, line {line}"
            yield _example(_row_fields(row, columns, where), spec, where)


def _row_fields(row: list[str], columns: dict[str, int], where: str) -> dict[str, str]:
    fields = {}
    for name, col in columns.items():
        if col >= len(row):
            raise HLMError(
                f"{where}: missing field {name!r} (column {col + 1}; the row has {len(row)} "
                "tab-separated columns)"
            )
        if name == "label" and not row[col].strip():
            raise HLMError(f"{where}: empty field 'label'")
        fields[name] = row[col]
    return fields


def _read_jsonl(path: Path, spec: TaskSpec) -> Iterator[Example]:
    for where, record in json_objects(path, expected=", ".join(_needed(spec))):
        yield _example(_record_fields(record, spec, where), spec, where)


def _record_fields(record: dict[str, Any], spec: TaskSpec, where: str) -> dict[str, Any]:
    fields = {}
    for name in _needed(spec):
        key = next((k for k in (name, *spec.aliases.get(name, ())) if k in record), None)
        if key is None or record[key] is None:
            raise HLMError(f"{where}: missing field {name!r}")
        fields[name] = record[key]
    return fields


def read_examples(path: str | Path, spec: TaskSpec) -> list[Example]:
    """Every example of a .tsv / .txt (tab-separated) or .jsonl / .json (JSON lines) file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise HLMError(f"{spec.name}: no file {path}; pass an existing .tsv or .jsonl file")
    if path.suffix in (".jsonl", ".json"):
        examples = list(_read_jsonl(path, spec))
    elif path.suffix in (".tsv", ".txt"):
        examples = list(_read_tsv(path, spec))
    else:
        raise HLMError(f"cannot read {path}: use a tab-separated .tsv or a JSON-lines .jsonl file")
    if not examples:
        raise HLMError(f"{path} holds no examples")
    return examples


# ----------------------------------------------------------------------------- splits


def split_indices(n: int, eval_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) row indices of an n-row file: a seeded permutation, eval rows first."""
    if not 0.0 < eval_fraction < 1.0:
        raise HLMError(f"eval_fraction={eval_fraction} must be between 0 and 1 (exclusive)")
    perm = np.random.default_rng(split_seed).permutation(n)
    n_eval = round(eval_fraction * n)
    if n_eval < 1 or n_eval >= n:
        raise HLMError(
            f"eval_fraction={eval_fraction} of {n} rows leaves an empty train or eval split"
        )
    return perm[n_eval:], perm[:n_eval]


def _split_note(what: str, eval_fraction: float, split_seed: int) -> str:
    return (
        f"a split of {what}: numpy default_rng({split_seed}).permutation(n), the first "
        f"round({eval_fraction}*n) rows evaluate, the rest train; never report it as a GLUE/XNLI "
        "dev score"
    )


def _eval_languages(spec: TaskSpec, eval_languages: str | Sequence[str] | None) -> list[str]:
    """The XNLI languages to evaluate (["eval"]'s analogue for GLUE is handled by the caller)."""
    if spec.language is None:
        if eval_languages:
            raise HLMError(f"{spec.name} has one evaluation set; eval_languages is for xnli tasks")
        return []
    if eval_languages is None:
        return [spec.language]
    if eval_languages == "all":
        return list(XNLI_LANGUAGES)
    if isinstance(eval_languages, str):
        eval_languages = [lang.strip() for lang in eval_languages.split(",") if lang.strip()]
    unknown = [lang for lang in eval_languages if lang not in XNLI_LANGUAGES]
    if unknown or not eval_languages:
        raise HLMError(
            f"eval_languages={unknown or eval_languages!r}: use 'all' or a list of "
            f"{', '.join(XNLI_LANGUAGES)}"
        )
    return list(dict.fromkeys(eval_languages))


def _from_files(spec, train_file, eval_file, langs, eval_fraction, split_seed) -> TaskData:
    key = spec.language or GLUE_EVAL
    if any(lang != spec.language for lang in langs):
        raise HLMError(
            f"eval_languages={langs} needs the shared XNLI files or the hub; with --train-file/"
            "--eval-file only the given file is evaluated"
        )
    if train_file is not None and eval_file is not None:
        train = read_examples(train_file, spec)
        evals = {key: read_examples(eval_file, spec)}
        return TaskData(spec, train, evals, "files", f"train {train_file}, eval {eval_file}")
    path = train_file if train_file is not None else eval_file
    rows = read_examples(path, spec)
    train_idx, eval_idx = split_indices(len(rows), eval_fraction, split_seed)
    note = _split_note(f"the file {path}", eval_fraction, split_seed)
    return TaskData(
        spec, [rows[i] for i in train_idx], {key: [rows[i] for i in eval_idx]}, "file-split", note
    )


def _from_shared(spec: TaskSpec, langs: list[str], eval_fraction, split_seed) -> TaskData:
    train_rows = read_examples(data_dir() / spec.shared_path, spec)
    train_idx, eval_idx = split_indices(len(train_rows), eval_fraction, split_seed)
    train = [train_rows[i] for i in train_idx]
    what = f"the dev file {data_dir() / spec.shared_path}"
    if spec.language is None:
        evals = {GLUE_EVAL: [train_rows[i] for i in eval_idx]}
    else:
        evals = {}
        for lang in langs:
            rows = train_rows if lang == spec.language else _shared_rows(TASKS[f"xnli:{lang}"])
            if len(rows) != len(train_rows):
                raise HLMError(
                    f"XNLI dev files must be row-aligned: {lang} has {len(rows)} rows, "
                    f"{spec.language} has {len(train_rows)}"
                )
            evals[lang] = [rows[i] for i in eval_idx]
        what = "the row-aligned XNLI dev files (the same rows in every language)"
    note = _split_note(what, eval_fraction, split_seed)
    return TaskData(spec, train, evals, "shared-dev-split", note)


def _shared_rows(spec: TaskSpec) -> list[Example]:
    return read_examples(data_dir() / spec.shared_path, spec)


def _hub_split(spec: TaskSpec, split: str) -> list[Example]:
    ds = load_hub(spec.hub_name, spec.hub_name, spec.hub_config, split)
    where = f"{spec.hub_name}:{spec.hub_config}/{split}"
    return [
        _example(_record_fields(row, spec, f"{where}, row {i}"), spec, f"{where}, row {i}")
        for i, row in enumerate(ds)
    ]


def _from_hub(spec: TaskSpec, langs: list[str]) -> TaskData:
    try:
        train = _hub_split(spec, "train")
        if spec.language is None:
            evals = {GLUE_EVAL: _hub_split(spec, "validation")}
        else:
            evals = {lang: _hub_split(TASKS[f"xnli:{lang}"], "validation") for lang in langs}
    except HLMError:
        raise
    except Exception as err:
        text = str(err).strip().splitlines()
        shipped = (
            f"no file {data_dir() / spec.shared_path}"
            if spec.shared_path
            else f"the shared data has no {spec.name} file (pass your own)"
        )
        raise HLMError(
            f"{spec.name}: {shipped}, and the hub dataset {spec.hub_name}:{spec.hub_config} could "
            f"not be loaded ({text[0] if text else type(err).__name__}); set {DATA_ENV} to the "
            "folder holding eval/ or pass --train-file/--eval-file"
        ) from err
    note = f"the hub dataset {spec.hub_name} (train / validation splits)"
    return TaskData(spec, train, evals, "hub", note)


def load_task(
    name: str,
    *,
    train_file: str | Path | None = None,
    eval_file: str | Path | None = None,
    eval_fraction: float = 0.2,
    split_seed: int = 0,
    eval_languages: str | Sequence[str] | None = None,
) -> TaskData:
    """The train and eval examples of task `name` (see the module docstring for the sources).

    `eval_languages` (XNLI only): None (the task's language), "all" (the paper's seven), or a
    list / comma-separated string of language codes."""
    spec = get_task(name)
    langs = _eval_languages(spec, eval_languages)
    if train_file is not None or eval_file is not None:
        return _from_files(spec, train_file, eval_file, langs, eval_fraction, split_seed)
    shared = [spec.shared_path] if spec.shared_path else []
    shared += [TASKS[f"xnli:{lang}"].shared_path for lang in langs]
    if shared and all(has_shared(p) for p in shared):
        return _from_shared(spec, langs, eval_fraction, split_seed)
    return _from_hub(spec, langs)
