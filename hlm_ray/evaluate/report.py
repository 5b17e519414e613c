"""The evaluation tasks `hlm eval` runs, their JSON results, and a table for the terminal.

    from hlm_ray.evaluate.report import format_results, get_task, write_result
    result = get_task("lambada").run(pre, output_dir=out, limit=None, batch_size=32,
                                     device="cpu", progress=True)
    write_result(result, out)            # out/eval_lambada.json
    print(format_results([result]))

A result is ``{"task", "model", "metrics": {flat name: number}, "figures": [paths], "seconds",
...task details}``; "note" says when a number needs a caveat.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.evaluate.bpb import DEFAULT_NUM_TEXTS, bits_per_byte, default_bpb_texts
from hlm_ray.evaluate.common import CONTEXT_METRIC, context_length_of
from hlm_ray.evaluate.embeddings import anisotropy, synonym_similarity
from hlm_ray.evaluate.floor import floor_missing, run_floor
from hlm_ray.evaluate.lambada import LAMBADA_FILE, LAMBADA_HUB, load_lambada, score_lambada
from hlm_ray.paths import has_shared
from hlm_ray.pretrained import Pretrained

RAW_HEAD_NOTE = "raw Eᵀ head: headless decoder not fine-tuned"
PRIOR_NOTE = "prior readout: headless decoder not fine-tuned, Eᵀ + log unigram prior"
ANISOTROPY_TEXTS = 200


@dataclass(frozen=True)
class EvalTask:
    name: str
    description: str
    needs_decoder: bool
    fn: Callable[..., dict]

    def run(
        self,
        pre: Pretrained,
        *,
        output_dir: Path,
        limit: int | None = None,
        batch_size: int = 32,
        device: str | None = None,
        progress: bool = True,
    ) -> dict:
        """Run the task on `pre`; the result dict with its wall time in "seconds"."""
        if self.needs_decoder and pre.family != "decoder":
            raise HLMError(f"{self.name} needs a decoder; {pre.source} is an {pre.family}")
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        details = self.fn(
            pre,
            output_dir=output_dir,
            limit=limit,
            batch_size=batch_size,
            device=device,
            progress=progress,
        )
        result = {
            "task": self.name,
            "model": str(pre.source),
            "family": pre.family,
            "objective": pre.objective,
            "finetuned": pre.finetuned,
            "metrics": details.pop("metrics"),
            "figures": [str(p) for p in details.pop("figures", [])],
            "seconds": round(time.perf_counter() - start, 3),
            **details,
        }
        readout = getattr(pre, "readout", None)  # hlm_ray.readout.Readout, when attached
        if self.needs_decoder and readout is not None:
            result["readout"] = {"name": readout.name, "note": readout.note}
        if self.needs_decoder and pre.objective == "headless" and not pre.finetuned:
            if readout is not None and readout.name == "prior":
                result["note"] = PRIOR_NOTE
            else:
                # The paper reports this too (LAMBADA ppl 524): the tied Eᵀ head scores tokens.
                result["note"] = RAW_HEAD_NOTE
        return result

    __call__ = run  # a task is called like the function the CLI expects


def _trained_context(pre: Pretrained) -> tuple[int, str]:
    """The length a decoder is scored at: what it was trained on (see evaluate/common.py)."""
    return context_length_of(pre.run_config, getattr(pre.model, "config", None), str(pre.source))


def _at_trained_length(pre: Pretrained, scorer, data, length_keyword: str, options: dict):
    """`scorer(model, tokenizer, data, **options)` at the context length `pre` was trained on;
    its output, that length and where the length came from (every decoder score records them)."""
    length, source = _trained_context(pre)
    out = scorer(pre.model, pre.tokenizer, data, **{length_keyword: length}, **options)
    return out, length, source


def _lambada(pre: Pretrained, *, output_dir, limit, **options) -> dict:
    examples = load_lambada(limit=limit)
    metrics, length, source = _at_trained_length(
        pre, score_lambada, examples, "max_length", options
    )
    floor = run_floor(pre)
    if floor is not None:
        metrics.update(floor.lambada_perplexity(pre.tokenizer, examples))
    return {
        "metrics": {**metrics, CONTEXT_METRIC: length},
        "context_length_source": source,
        "data": _lambada_source(),
        "protocol": "lm-eval lambada_openai",
        "floor": floor.source if floor else f"none: {floor_missing(pre)}",
    }


def _lambada_source() -> str:
    return LAMBADA_FILE if has_shared(LAMBADA_FILE) else LAMBADA_HUB[0]


def _bpb(pre: Pretrained, *, output_dir, limit, **options) -> dict:
    texts = default_bpb_texts(limit=limit or DEFAULT_NUM_TEXTS)
    out, length, source = _at_trained_length(pre, bits_per_byte, texts, "seq_len", options)
    metrics = {
        "bpb/bits_per_byte": out["bpb"],
        "bpb/nats_per_token": out["nats_per_token"],
        CONTEXT_METRIC: length,
    }
    floor = run_floor(pre)  # the unigram model of the run's training tokens, the same texts
    if floor is not None:
        metrics.update(floor.bpb(pre.tokenizer, texts))
    details = {k: out[k] for k in ("tokens", "bytes", "documents")}
    details["floor"] = floor.source if floor else f"none: {floor_missing(pre)}"
    return {
        "metrics": metrics,
        "context_length_source": source,
        "data": f"{_lambada_source()} passages",
        **details,
    }


def _synonyms(pre: Pretrained, *, output_dir, limit, batch_size, device, progress) -> dict:
    figure = output_dir / "synonyms.png"
    metrics = synonym_similarity(pre.model, pre.tokenizer, plot_path=figure, title=pre.source)
    return {"metrics": metrics, "figures": [figure], "data": "WordNet 3.0 synonym pairs"}


def _anisotropy(pre: Pretrained, *, output_dir, limit, batch_size, device, progress) -> dict:
    figure = output_dir / "anisotropy.png"
    texts = default_bpb_texts(limit=limit or ANISOTROPY_TEXTS)
    metrics = anisotropy(
        pre.model,
        pre.tokenizer,
        texts,
        batch_size=batch_size,
        device=device,
        plot_path=figure,
        title=pre.source,
    )
    return {"metrics": metrics, "figures": [figure], "data": f"{_lambada_source()} passages"}


EVAL_TASKS: dict[str, EvalTask] = {
    task.name: task
    for task in (
        EvalTask(
            "lambada", "LAMBADA accuracy and perplexity (lm-eval lambada_openai)", True, _lambada
        ),
        EvalTask("bpb", "bits per byte of held-out text (LAMBADA passages)", True, _bpb),
        EvalTask(
            "synonyms", "input-embedding cosine of WordNet synonyms vs random", False, _synonyms
        ),
        EvalTask("anisotropy", "mean cosine of random token pairs per layer", False, _anisotropy),
    )
}


def get_task(name: str) -> EvalTask:
    if name.startswith("harness:"):  # lm-evaluation-harness tasks (evaluate/harness.py)
        from hlm_ray.evaluate.harness import harness_task

        task_name, description, fn = harness_task(name)
        return EvalTask(task_name, description, True, fn)
    from hlm_ray.evaluate.harness import check_tasks

    check_tasks([name])
    return EVAL_TASKS[name]


def write_result(result: dict, output_dir: str | Path) -> Path:
    """`result` as ``<output_dir>/eval_<task>.json``."""
    out = Path(output_dir) / f"eval_{result['task']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return out


def format_results(results: list[dict]) -> str:
    """Markdown: one table per task (in first-seen order), a row per model, a column per
    metric; notes ("raw Eᵀ head ...") numbered below the table they belong to."""
    tasks = list(dict.fromkeys(result["task"] for result in results))
    return "\n\n".join(_task_table([r for r in results if r["task"] == t]) for t in tasks)


def _task_table(results: list[dict]) -> str:
    columns: list[str] = []
    for result in results:
        columns += [name for name in result["metrics"] if name not in columns]
    lines = [
        "| " + " | ".join(["model", "task", *columns]) + " |",
        "|" + "---|" * (2 + len(columns)),
    ]
    notes: list[str] = []
    for result in results:
        mark = ""
        if result.get("note"):
            notes.append(result["note"])
            mark = f" [{len(notes)}]"
        cells = [result["model"] + mark, result["task"]]
        cells += [_number(result["metrics"].get(name)) for name in columns]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"[{i}] {note}" for i, note in enumerate(notes, start=1)]
    return "\n".join(lines)


def _number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return str(value)
