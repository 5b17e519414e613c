"""GLUE's metrics in plain numpy (scikit-learn and scipy are test-only dependencies).

    from hlm_ray.classify.metrics import task_metrics
    task_metrics("glue:mrpc", preds, labels)     # {"accuracy": 0.84, "f1": 0.88}
    task_metrics("glue:cola", preds, labels)     # {"mcc": 0.41, "accuracy": 0.79}
    task_metrics("glue:stsb", scores, gold)      # {"spearman": 0.8, "pearson": 0.81}

Undefined correlations (a constant input) are reported as 0.0, as scikit-learn does for MCC,
rather than NaN, so a degenerate epoch never wins or breaks the best-epoch choice.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hlm_ray.classify.tasks import TaskSpec, get_task
from hlm_ray.errors import HLMError


def accuracy(preds: np.ndarray, labels: np.ndarray) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    return float(np.mean(preds == labels)) if len(labels) else 0.0


def f1(preds: np.ndarray, labels: np.ndarray, positive: int = 1) -> float:
    """Binary F1 of class `positive`; 0.0 when it is neither predicted nor present."""
    pred_pos, true_pos = np.asarray(preds) == positive, np.asarray(labels) == positive
    tp = np.sum(pred_pos & true_pos)
    wrong = np.sum(pred_pos != true_pos)  # false positives + false negatives
    return float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0


def matthews_corrcoef(preds: np.ndarray, labels: np.ndarray) -> float:
    """Multi-class Matthews correlation (Gorodkin's R_K, as scikit-learn computes it)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    classes, codes = np.unique(np.concatenate([labels, preds]), return_inverse=True)
    true_k, pred_k = codes[: len(labels)], codes[len(labels) :]
    k = len(classes)
    confusion_KK = np.zeros((k, k), dtype=np.float64)
    np.add.at(confusion_KK, (true_k, pred_k), 1.0)
    t_k, p_k = confusion_KK.sum(axis=1), confusion_KK.sum(axis=0)  # true / predicted per class
    n, correct = confusion_KK.sum(), np.trace(confusion_KK)
    cov_pt = correct * n - t_k @ p_k
    cov_pp, cov_tt = n * n - p_k @ p_k, n * n - t_k @ t_k
    denom = np.sqrt(cov_pp * cov_tt)
    return float(cov_pt / denom) if denom > 0 else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    y = np.asarray(y, dtype=np.float64) - np.mean(y)
    denom = np.sqrt((x @ x) * (y @ y))
    return float(np.clip((x @ y) / denom, -1.0, 1.0)) if denom > 0 else 0.0


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span."""
    values = np.asarray(values)
    order = np.argsort(values, kind="stable")
    sorted_vals = values[order]
    starts = np.r_[True, sorted_vals[1:] != sorted_vals[:-1]]  # first of each tie group
    group = np.cumsum(starts) - 1  # tie-group index of each sorted position
    bounds = np.r_[np.flatnonzero(starts), len(values)]  # group g spans [bounds[g], bounds[g+1])
    mean_rank = (bounds[:-1] + bounds[1:] + 1) / 2.0  # mean of 1-based ranks lo+1 .. hi
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = mean_rank[group]
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(average_ranks(x), average_ranks(y))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def task_metrics(task: TaskSpec | str, preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's metrics (a `TaskSpec` or its name): class ids, or scores for regression."""
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    if len(preds) != len(labels):
        raise HLMError(f"{len(preds)} predictions for {len(labels)} labels")
    return {name: METRICS[name](preds, labels) for name in spec.metrics}
