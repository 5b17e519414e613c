"""LAMBADA (OpenAI version), scored exactly as lm-evaluation-harness's `lambada_openai` task.

Each passage is a context and its final word; the model must give the word's tokens. Two numbers:
accuracy (every continuation token is the model's argmax) and perplexity
(``exp(-mean over passages of the summed log-likelihood of the continuation)``: lm-eval's
`perplexity` aggregation, so it is per passage, not per token).

    from hlm_ray.evaluate.lambada import load_lambada, score_lambada
    examples = load_lambada(limit=500)       # [{"context", "continuation"}], shared file or hub
    metrics = score_lambada(model, tokenizer, examples, batch_size=32, device="cuda")
    metrics["lambada/accuracy"], metrics["lambada/perplexity"]

Encoding follows lm-eval's `_encode_pair`: the target is ``" " + word``; trailing whitespace of
the context moves into the continuation; ``context_enc = tok(context)``,
``continuation_enc = tok(context + continuation)[len(context_enc):]``; no special tokens; the
input is ``(context_enc + continuation_enc)[-(max_length + 1):][:-1]`` (the context is
left-truncated, the continuation always kept). `hlm eval` passes the length the model was
trained on as `max_length` (`evaluate.common.trained_context_length`) and records it as
``eval/context_length``; called without it, the model's positions are the limit.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hlm_ray.errors import HLMError, one_line
from hlm_ray.evaluate.common import eval_mode
from hlm_ray.jsonl import json_objects
from hlm_ray.models import max_input_positions
from hlm_ray.paths import DATA_ENV, data_dir, data_dir_said, has_shared, load_hub, shared_file

LAMBADA_FILE = "eval/lambada_openai.jsonl"
# What lm-eval's lambada_openai.yaml loads (the "en" config holds the same 5,153 passages).
LAMBADA_HUB = ("EleutherAI/lambada_openai", "default", "test")
_FIELDS = ("context", "continuation")


# ----------------------------------------------------------------------------- data


def load_lambada(source: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The passages as ``[{"context", "continuation"}]``, in file order (the first `limit`).

    `source`: a JSON-lines file; None reads ``eval/lambada_openai.jsonl`` from the data folder
    (HLM_DATA_DIR), else the hub dataset EleutherAI/lambada_openai."""
    if limit is not None and limit <= 0:
        raise HLMError(f"limit={limit} must be a positive number of passages (or None for all)")
    if source is not None:
        path = Path(source).expanduser()
        if not path.is_file():
            raise HLMError(
                f"no LAMBADA file at {path}; pass a JSON-lines file with "
                '{"context", "continuation"} rows'
            )
        return _read_jsonl(path, limit)
    if has_shared(LAMBADA_FILE):
        return _read_jsonl(shared_file(LAMBADA_FILE), limit)
    return _from_hub(limit)


def _read_jsonl(path: Path, limit: int | None) -> list[dict]:
    examples = []
    rows = json_objects(path, expected='{"context": ..., "continuation": ...}')
    for where, row in itertools.islice(rows, limit):  # lines past the limit are not parsed
        for field in _FIELDS:
            if not isinstance(row.get(field), str) or not row[field]:
                raise HLMError(
                    f"{where}: missing or empty field {field!r} "
                    '(each line must be {"context": ..., "continuation": ...})'
                )
        examples.append({"context": row["context"], "continuation": row["continuation"]})
    if not examples:
        raise HLMError(f"{path} holds no LAMBADA passages")
    return examples


def _from_hub(limit: int | None) -> list[dict]:
    name, config, split = LAMBADA_HUB
    what = f"LAMBADA: {LAMBADA_FILE} is not in {data_dir()}, and {name}"
    try:
        rows = load_hub(what, name, config, split)
    except HLMError:  # no datasets package: its own line
        raise
    except Exception as err:  # offline: ConnectionError, DatasetNotFoundError, OSError, ...
        first = one_line(err)
        raise HLMError(
            f"LAMBADA: {LAMBADA_FILE} is not in the data folder {data_dir_said()}, and the hub dataset "
            f"{name} could not be loaded ({first}); set {DATA_ENV} to the folder that holds it "
            "or pass a JSON-lines file"
        ) from None
    examples = []
    for row in rows:
        if limit is not None and len(examples) >= limit:
            break
        # lm-eval: doc_to_text = all words but the last, doc_to_target = " " + the last word.
        context, _, word = row["text"].rpartition(" ")
        examples.append({"context": context, "continuation": word})
    return examples


# ----------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class Request:
    """One passage as the model sees it: `tokens` = (context + continuation)[-(max_len+1):];
    the input is tokens[:-1] and the last `num_continuation` tokens are scored."""

    tokens: tuple[int, ...]
    num_continuation: int


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context_enc, continuation_enc) exactly as lm-eval builds them for lambada_openai."""
    target = " " + continuation  # lambada_openai's doc_to_target
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        target = context[-num_spaces:] + target
        context = context[:-num_spaces]
    whole = tokenizer.encode(context + target, add_special_tokens=False)
    if not context:  # lm-eval conditions an empty context on the end-of-text token
        return [tokenizer.eos_token_id], whole
    context_enc = tokenizer.encode(context, add_special_tokens=False)
    return context_enc, whole[len(context_enc) :]


def make_requests(tokenizer, examples: list[dict], max_length: int | None = None) -> list[Request]:
    """The encoded passages, left-truncated to `max_length` input tokens (None: no limit)."""
    requests = []
    for i, example in enumerate(examples):
        context_enc, continuation_enc = encode_pair(
            tokenizer, example["context"], example["continuation"]
        )
        if not continuation_enc:
            raise HLMError(f"LAMBADA passage {i}: the continuation encodes to no tokens")
        if max_length is not None and len(continuation_enc) > max_length:
            raise HLMError(
                f"LAMBADA passage {i}: its continuation has {len(continuation_enc)} tokens, more "
                f"than the model's {max_length} positions"
            )
        tokens = context_enc + continuation_enc
        if max_length is not None:
            tokens = tokens[-(max_length + 1) :]
        requests.append(Request(tuple(tokens), len(continuation_enc)))
    return requests


# ----------------------------------------------------------------------------- scoring


def score_lambada(
    model,
    tokenizer,
    examples: list[dict],
    *,
    batch_size: int = 32,
    device: str | None = None,
    progress: bool = True,
    max_length: int | None = None,
    return_per_example: bool = False,
) -> dict:
    """Accuracy and perplexity of a causal LM on `examples`, batched.

    Passages are sorted longest first and right-padded, so a batch holds similar lengths.
    `max_length` overrides the model's positions. `return_per_example` adds
    ``"per_example": [(loglikelihood, is_greedy)]`` in the order of `examples`."""
    if batch_size < 1:
        raise HLMError(f"batch_size={batch_size} must be at least 1")
    if not examples:
        raise HLMError("no LAMBADA passages to score")
    requests = make_requests(
        tokenizer, examples, max_length or max_input_positions(getattr(model, "config", None))
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    batches = range(0, len(order), batch_size)
    with eval_mode(model, device) as device:
        for start in tqdm(batches, desc="lambada", unit="batch", disable=not progress):
            chunk = order[start : start + batch_size]
            scored = _score_batch(model, [requests[i] for i in chunk], pad_id, device)
            for i, result in zip(chunk, scored, strict=True):
                results[i] = result
    return _aggregate(results, requests, return_per_example)


def _score_batch(
    model, requests: list[Request], pad_id: int, device: torch.device
) -> list[tuple[float, bool]]:
    """(summed log-likelihood, all-greedy) of each request's continuation."""
    lengths = [len(r.tokens) - 1 for r in requests]  # input lengths
    num_rows, width = len(requests), max(lengths)
    input_ids_BL = torch.full((num_rows, width), pad_id, dtype=torch.long)
    mask_BL = torch.zeros((num_rows, width), dtype=torch.long)
    for row, (request, length) in enumerate(zip(requests, lengths, strict=True)):
        input_ids_BL[row, :length] = torch.tensor(request.tokens[:-1])
        mask_BL[row, :length] = 1
    # Input position t predicts token t + 1: row b's continuation is predicted at positions
    # [len_b - C_b, len_b). Only logits from the earliest such position on are needed.
    first = min(n - r.num_continuation for n, r in zip(lengths, requests, strict=True))
    kwargs = {"logits_to_keep": width - first} if _takes_logits_to_keep(model) else {}
    logits = model(
        input_ids=input_ids_BL.to(device), attention_mask=mask_BL.to(device), **kwargs
    ).logits
    offset = width - logits.shape[1]  # position of logits[:, 0]
    max_cont = max(r.num_continuation for r in requests)
    positions_BC = torch.zeros((num_rows, max_cont), dtype=torch.long)
    targets_BC = torch.zeros((num_rows, max_cont), dtype=torch.long)
    valid_BC = torch.zeros((num_rows, max_cont), dtype=torch.bool)
    for row, (request, length) in enumerate(zip(requests, lengths, strict=True)):
        c = request.num_continuation
        positions_BC[row, :c] = torch.arange(length - c, length) - offset
        targets_BC[row, :c] = torch.tensor(request.tokens[-c:])
        valid_BC[row, :c] = True
    positions_BC, targets_BC, valid_BC = (
        t.to(logits.device) for t in (positions_BC, targets_BC, valid_BC)
    )
    # Slice first, then float32: log_softmax never sees the whole (B, L, V).
    index_BCV = positions_BC.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    cont_logits_BCV = logits.gather(1, index_BCV).float()
    logprobs_BCV = cont_logits_BCV.log_softmax(dim=-1)
    token_ll_BC = logprobs_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1)
    greedy_BC = cont_logits_BCV.argmax(dim=-1) == targets_BC
    loglik_B = (token_ll_BC * valid_BC).sum(dim=1)
    all_greedy_B = (greedy_BC | ~valid_BC).all(dim=1)
    return [
        (float(ll), bool(g)) for ll, g in zip(loglik_B.tolist(), all_greedy_B.tolist(), strict=True)
    ]


def _takes_logits_to_keep(model) -> bool:
    """HF causal LMs accept `logits_to_keep` (the head runs on the last positions only)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _aggregate(results, requests: list[Request], per_example: bool) -> dict:
    logliks = [ll for ll, _ in results]
    out = {
        "lambada/accuracy": sum(g for _, g in results) / len(results),
        "lambada/perplexity": _perplexity(sum(logliks) / len(logliks)),
        "lambada/num_examples": len(results),
        "lambada/mean_continuation_tokens": sum(r.num_continuation for r in requests)
        / len(requests),
    }
    if per_example:
        out["per_example"] = list(results)
    return out


def _perplexity(mean_loglik: float) -> float:
    """exp(-mean log-likelihood), or inf where that is past the largest float (a mean below
    about -709 nats: a badly trained model, or a long enough continuation)."""
    try:
        return math.exp(-mean_loglik)
    except OverflowError:
        return math.inf


def score_lambada_reference(
    model,
    tokenizer,
    examples: list[dict],
    *,
    max_length: int | None = None,
    return_per_example: bool = False,
) -> dict:
    """The same numbers one passage at a time, as lm-eval's loop does it (a test reference)."""
    requests = make_requests(
        tokenizer, examples, max_length or max_input_positions(getattr(model, "config", None))
    )
    results = []
    with eval_mode(model, None) as device:
        for request in requests:
            inp = torch.tensor([request.tokens[:-1]], device=device)
            logprobs_LV = model(input_ids=inp).logits[0].double().log_softmax(-1)
            c = request.num_continuation
            cont_LV = logprobs_LV[-c:]
            target = torch.tensor(request.tokens[-c:], device=device)
            loglik = cont_LV[torch.arange(c), target].sum().item()
            results.append((loglik, bool((cont_LV.argmax(-1) == target).all())))
    return _aggregate(results, requests, return_per_example)
