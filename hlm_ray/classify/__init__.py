"""Sequence classification on top of a pretrained encoder (GLUE and XNLI).

    from hlm_ray.classify import finetune_classifier, load_task, TASKS, TINY, PAPER
    data = load_task("glue:sst2")                 # a documented split of the dev file here
    result = finetune_classifier("runs/tiny-enc", "glue:sst2", TINY, output_dir=Path("out"))
    result["summary"]["eval/accuracy"]["mean"]

Modules: `tasks` (the task registry and data loading), `metrics` (GLUE metrics in numpy),
`loss` (balanced and plain cross-entropy), `recipes` (tiny and the paper's settings), `inputs`
(pairs to token ids, batches), `model` (the classifier's load and save), `loop` (epochs per
seed, the best epoch), `finetune` (`finetune_classifier`, the entry point).
"""

from hlm_ray.classify.finetune import finetune_classifier
from hlm_ray.classify.recipes import PAPER, PAPER_XNLI, RECIPES, TINY, recipe
from hlm_ray.classify.tasks import TASKS, Example, TaskData, TaskSpec, get_task, load_task

__all__ = [
    "PAPER",
    "PAPER_XNLI",
    "RECIPES",
    "TASKS",
    "TINY",
    "Example",
    "TaskData",
    "TaskSpec",
    "finetune_classifier",
    "get_task",
    "load_task",
    "recipe",
]
