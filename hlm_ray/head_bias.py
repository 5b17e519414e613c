"""A trainable bias on a decoder's output head, started at the log unigram prior
(`init.prior_bias`): the vanilla arm offered what the headless arm's prior readout knows.

    add_head_bias(model, log_q_V)            # the head: logits = h·Wᵀ + b, b initialised to log q
    head_bias_of(model)                      # the (V,) bias Parameter, or None
    restore_head_bias(model, folder)         # after from_pretrained: put the saved bias back

transformers' GPT-NeoX and GPT-2 heads are `nn.Linear(..., bias=False)` (their modeling files
fix it), so the bias is added here by swapping the head for an `nn.Linear` with a bias that
shares the head's weight Parameter (a tied GPT-2 head stays tied). `save_pretrained` writes it
into model.safetensors under the head's name (`embed_out.bias` for GPT-NeoX, `lm_head.bias`
for GPT-2); plain `from_pretrained` reports that key as unused and drops it, so hlm_ray's
loader (`hlm_ray.pretrained.load_pretrained`) reads it (`saved_head_bias`) and puts it back;
`restore_head_bias` does the same for a model loaded some other way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

BIAS_KEYS = ("lm_head.bias", "embed_out.bias")
"""Where the head's bias is saved (GPT-2, and GPT-NeoX under its legacy name)."""


def add_head_bias(model, bias_V) -> nn.Parameter:
    """Give the decoder's output head a trainable bias (V,) set to `bias_V`; returns it."""
    weight = model.get_output_embeddings().weight
    # Built on the meta device: no memory, and no draw from the RNG a seeded run relies on.
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=True, device="meta")
    new.weight = weight  # the same Parameter: tied heads stay tied, the optimizer sees one
    bias = torch.as_tensor(bias_V).to(device=weight.device, dtype=weight.dtype).clone()
    new.bias = nn.Parameter(bias, requires_grad=weight.requires_grad)
    model.set_output_embeddings(new)
    return new.bias


def head_bias_of(model) -> nn.Parameter | None:
    head = model.get_output_embeddings()
    head = getattr(head, "head", head)  # under a ReadoutHead
    return getattr(head, "bias", None)


def saved_head_bias(folder: str | Path) -> torch.Tensor | None:
    """The head bias saved in the folder's model.safetensors (None when it has none)."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        saved = set(f.keys())  # the file's tensor names (its header only)
        for key in BIAS_KEYS:
            if key in saved:
                return f.get_tensor(key)
    return None


def restore_head_bias(model, folder: str | Path) -> bool:
    """Put the folder's saved head bias back on a model `from_pretrained` loaded (which drops
    it); True when there was one."""
    bias = saved_head_bias(folder)
    if bias is None:
        return False
    add_head_bias(model, bias)
    return True
