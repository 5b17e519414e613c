"""What a classifier scores without learning anything: the line a fine-tuned score must clear.

    from hlm_ray.classify.baselines import majority_baseline, chance_baseline
    majority_baseline("glue:sst2", eval_limit=512)   # 0.5086...: accuracy of always the top class
    majority_baseline("glue:cola")                   # 0.0: MCC of a constant prediction
    chance_baseline("xnli:en")                       # 1/3: three balanced classes

`majority_baseline` predicts the most frequent class of the *evaluation* labels (the same rows
`finetune_classifier` evaluates: `load_task`'s split, then its `eval_limit` subset) and scores
that constant prediction with the task's main metric, so it is exactly what a collapsed
classifier reports (accuracy = the majority share; MCC = 0; F1 of the positive class when the
majority is positive). `chance_baseline` is 1 / classes, for XNLI, whose classes are balanced by
construction.
"""

from __future__ import annotations

import numpy as np

from hlm_ray.classify.metrics import task_metrics
from hlm_ray.classify.tasks import get_task, load_task


def majority_scores(task: str, labels: list[int]) -> dict[str, float]:
    """Every metric of `task` for the constant prediction of the most frequent of `labels`
    (ties: the smallest class id)."""
    spec = get_task(task)
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=spec.num_labels)
    majority = int(np.argmax(counts))
    return task_metrics(spec, np.full(len(labels), majority), np.asarray(labels))


def majority_baseline(
    task: str,
    *,
    eval_limit: int | None = None,
    eval_fraction: float = 0.2,
    split_seed: int = 0,
) -> float:
    """The task's main metric for always predicting the majority class of its evaluation rows
    (the rows `finetune_classifier` evaluates with these settings)."""
    from hlm_ray.classify.inputs import limit_examples

    spec = get_task(task)
    data = load_task(task, eval_fraction=eval_fraction, split_seed=split_seed)
    rows = next(iter(data.eval.values()))
    labels = [int(e.label) for e in limit_examples(rows, eval_limit)]
    return majority_scores(task, labels)[spec.main_metric]


def chance_baseline(task: str) -> float:
    """1 / number of classes (XNLI: 1/3)."""
    return 1.0 / get_task(task).num_labels
