"""What every evaluation shares: running a model for scoring, and the context it is scored at.

    with eval_mode(model, "cuda") as device:      # eval mode, no autograd, train mode restored
        logits = model(input_ids.to(device)).logits
    n = trained_context_length("runs/tiny-headless/model")   # the run's data.seq_len

How long a scored input may be is the length the model was *trained* on, not its
`max_position_embeddings`: gpt2-11m has 1,024 positions but trains on 128-token blocks, so
positions 129+ hold untrained embeddings and a longer context only adds noise. For a model hlm
did not train (no `config.yaml` beside it) the model's own positions are used, and the reason
is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hlm_ray.errors import HLMError

log = logging.getLogger(__name__)

CONTEXT_METRIC = "eval/context_length"
"""The metric every decoder score is recorded with: the input length it was scored at."""


@contextmanager
def eval_mode(model, device: str | None) -> Iterator[torch.device]:
    """`model` in eval mode without autograd, moved to `device` (None: left where it is);
    yields the device its inputs go to. Its train mode comes back afterwards."""
    if device is not None:
        model.to(device)
    param = next(model.parameters(), None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield param.device if param is not None else torch.device("cpu")
    finally:
        model.train(was_training)


def context_length_of(run_config, hf_config, where: str = "the model") -> tuple[int, str]:
    """(tokens, where the number came from) for a model trained with `run_config` (an hlm
    `Config`, or None for a model hlm did not train) whose HF config is `hf_config` (a
    `PretrainedConfig` or its config.json as a dict)."""
    from hlm_ray.models import max_input_positions

    positions = max_input_positions(hf_config)
    if run_config is not None:
        seq_len = run_config.data.seq_len
        if positions is not None and seq_len > positions:  # cannot happen for a validated run
            raise HLMError(
                f"{where} was trained on {seq_len}-token blocks but has only {positions} positions"
            )
        return seq_len, "data.seq_len of its training run"
    if positions is None:
        raise HLMError(
            f"{where} has no training config and its config gives no position limit; "
            "pass the context length (max_length / seq_len) explicitly"
        )
    reason = f"no hlm training config beside {where}: using its {positions} positions"
    log.warning("context length: %s", reason)
    return positions, "max_position_embeddings (not trained by hlm)"


def trained_context_length(model_dir: str | Path) -> int:
    """The input length a decoder is scored at: its training run's `data.seq_len` (from the
    `config.yaml` saved beside the model), else its `max_position_embeddings` (logged)."""
    from hlm_ray.pretrained import resolve_model_dir, run_config_of

    folder = resolve_model_dir(model_dir)
    hf_config = json.loads((folder / "config.json").read_text())
    length, _ = context_length_of(run_config_of(folder), hf_config, where=str(folder))
    return length
