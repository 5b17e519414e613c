"""Zero-shot and intrinsic evaluation: LAMBADA, bits per byte, synonyms, anisotropy.

    from hlm_ray.evaluate import EVAL_TASKS, format_results, get_task, write_result
    from hlm_ray.pretrained import load_pretrained
    pre = load_pretrained("runs/tiny-headless")
    result = get_task("lambada").run(pre, output_dir=Path("runs/tiny-headless/eval"))
    write_result(result, "runs/tiny-headless/eval")
    print(format_results([result]))

The scoring functions work on any Hugging Face model + tokenizer without the task layer:
`score_lambada`, `bits_per_byte`, `synonym_similarity`, `anisotropy`.
"""

from hlm_ray.evaluate.bpb import bits_per_byte, default_bpb_texts
from hlm_ray.evaluate.embeddings import anisotropy, synonym_pairs, synonym_similarity
from hlm_ray.evaluate.lambada import load_lambada, score_lambada, score_lambada_reference
from hlm_ray.evaluate.report import EVAL_TASKS, EvalTask, format_results, get_task, write_result

__all__ = [
    "EVAL_TASKS",
    "EvalTask",
    "anisotropy",
    "bits_per_byte",
    "default_bpb_texts",
    "format_results",
    "get_task",
    "load_lambada",
    "score_lambada",
    "score_lambada_reference",
    "synonym_pairs",
    "synonym_similarity",
    "write_result",
]
