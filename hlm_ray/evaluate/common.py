"""What every evaluation shares: running a model for scoring.

    with eval_mode(model, "cuda") as device:      # eval mode, no autograd, train mode restored
        logits = model(input_ids.to(device)).logits

How long an input may be is the model's own `hlm_ray.models.max_input_positions(model.config)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


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
