"""torch.compile for the training step: the whole objective (`optim.compile`) or the CWT loss
alone (`objective.cwt_compile`).

    from hlm_ray.train.compile import compile_objective, compiled

    module = compile_objective(LMObjective(model, cfg.objective))  # in place, same module
    loss_fn = compiled(headless_causal_loss)                        # cached per function

Both use ``dynamic=True``: K (the target rows) changes with masking and padding, and U (the
distinct target ids of the de-duplicated CWT) with every micro-batch, so static shapes would
recompile at each new size. Data-dependent ops (``torch.unique``, boolean row selection) end a
graph and run eagerly between compiled ones; the values and gradients are those of eager mode.
``HLM_COMPILE_BACKEND`` picks another backend (e.g. ``aot_eager``: no C++/Triton code
generation), for environments without a compiler.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch


def backend() -> str:
    return os.environ.get("HLM_COMPILE_BACKEND", "inductor")


@functools.cache
def _compiled(fn: Callable, backend_name: str) -> Callable:
    return torch.compile(fn, dynamic=True, backend=backend_name)


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)``, built once per function and backend."""
    return _compiled(fn, backend())


def compile_objective(module: torch.nn.Module) -> torch.nn.Module:
    """Compile the module's forward in place (`nn.Module.compile`): parameters, state_dict keys
    and DDP wrapping stay those of the eager module; returns it."""
    module.compile(dynamic=True, backend=backend())
    return module
