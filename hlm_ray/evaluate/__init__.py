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

import importlib

# Imported when first used (PEP 562): `hlm eval` checks its --task names with `harness`, a
# module of this package, before it imports torch and transformers through the others.
_LAZY = {
    "bits_per_byte": "bpb",
    "default_bpb_texts": "bpb",
    "anisotropy": "embeddings",
    "synonym_pairs": "embeddings",
    "synonym_similarity": "embeddings",
    "load_lambada": "lambada",
    "score_lambada": "lambada",
    "score_lambada_reference": "lambada",
    "EVAL_TASKS": "report",
    "EvalTask": "report",
    "format_results": "report",
    "get_task": "report",
    "write_result": "report",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
