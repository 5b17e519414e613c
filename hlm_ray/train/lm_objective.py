"""One model plus one objective as a module whose forward returns the loss.

Headless vs vanilla is a config value, not a different model: `LMObjective.forward` reads the
body's hidden states and hands them to the objective's free function. Putting the loss inside
`forward` is what lets DDP see every parameter the loss uses (the embedding table is read twice:
as inputs and as CWT targets).

    module = LMObjective(model, cfg.objective)
    out = module(input_ids_BL)                  # decoders
    out = module(masked_inputs_BL, labels_BL)   # encoders: labels = originals, -100 elsewhere
    out.loss.backward()

    module = LMObjective(model, cfg.objective, compile=True)  # optim.compile: torch.compile

A headless step never touches the vocabulary head: `hidden_states` runs the body only (a
headless decoder's tied Eᵀ head is not called), and the loss reads the embedding rows of the
micro-batch's targets. Nothing here forces a host-device sync except what the shapes need
(`torch.unique` for the de-duplicated CWT, boolean selection of masked rows).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from hlm_ray.config import ObjectiveConfig
from hlm_ray.fused_ce import check_vanilla_impl
from hlm_ray.models import hidden_states, input_embedding_weight, lm_head
from hlm_ray.objectives import (
    LossOutput,
    headless_causal_loss,
    headless_masked_loss,
    mixed_loss,
    vanilla_causal_loss,
    vanilla_masked_loss,
)
from hlm_ray.train.compile import compile_objective, compiled
from hlm_ray.train.optim import uses_sparse_embedding


class LMObjective(nn.Module):
    def __init__(self, model: PreTrainedModel, cfg: ObjectiveConfig, *, compile: bool = False):
        """``model`` already on its device: a fused vanilla kernel that cannot run there (not
        installed, not a GPU, a head bias Cut Cross-Entropy cannot take) is refused here, in
        one line, before any step. ``compile``: `compile_objective` (optim.compile)."""
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.causal = model.config.hlm_family == "decoder"
        if cfg.name in ("vanilla", "mixed") and cfg.vanilla_impl != "torch":
            has_bias = lm_head(model).bias is not None
            check_vanilla_impl(cfg.vanilla_impl, model.device, has_bias=has_bias)
        losses = (headless_causal_loss, headless_masked_loss)
        self._headless_losses = tuple(map(compiled, losses)) if cfg.cwt_compile else losses
        if compile:
            compile_objective(self)

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        labels_BL: torch.Tensor | None = None,
        *,
        negative_ids: torch.Tensor | None = None,
        negative_seed: int = 0,
        return_accuracy: bool = False,
    ) -> dict[str, LossOutput]:
        """The objective's loss under "loss", plus its parts ("cwt", "ce") for the mixed one.

        `negative_seed` seeds the sampled negative set when `objective.num_negatives` is set
        (the loop derives it from (seed, step, rank, micro-batch): reproducible on resume)."""
        hidden_BLD = hidden_states(self.model, input_ids_BL)
        parts: dict[str, LossOutput] = {}
        if self.cfg.name in ("headless", "mixed"):
            parts["cwt"] = self._cwt(
                hidden_BLD, input_ids_BL, labels_BL, negative_ids, negative_seed, return_accuracy
            )
        if self.cfg.name in ("vanilla", "mixed"):
            parts["ce"] = self._ce(hidden_BLD, input_ids_BL, labels_BL)
        if self.cfg.name == "mixed":
            parts["loss"] = mixed_loss(
                parts["cwt"],
                parts["ce"],
                cwt_weight=self.cfg.cwt_weight,
                ce_weight=self.cfg.ce_weight,
            )
        else:
            parts["loss"] = parts["cwt" if self.cfg.name == "headless" else "ce"]
        return parts

    def _cwt(self, hidden_BLD, input_ids_BL, labels_BL, negative_ids, seed, return_accuracy):
        sampled = self.cfg.num_negatives is not None
        kwargs = dict(
            num_negatives=self.cfg.num_negatives,
            generator=torch.Generator().manual_seed(seed) if sampled else None,
            temperature=self.cfg.temperature,
            variant=self.cfg.cwt_variant,
            chunk_size=self.cfg.cwt_chunk_size,
            negative_ids=negative_ids,
            return_accuracy=return_accuracy,
            # With the lazy embedding update the table's gradient stays sparse: the CWT gather
            # must not add a dense V×D gradient to the input look-up's sparse one.
            sparse_grad=uses_sparse_embedding(self.model),
        )
        weight_VD = input_embedding_weight(self.model)
        causal_loss, masked_loss = self._headless_losses
        if self.causal:
            return causal_loss(hidden_BLD, input_ids_BL, weight_VD, **kwargs)
        return masked_loss(hidden_BLD, labels_BL, weight_VD, **kwargs)

    def _ce(self, hidden_BLD, input_ids_BL, labels_BL):
        head = lm_head(self.model)
        kwargs = dict(
            impl=self.cfg.ce_impl,
            chunk_size=self.cfg.ce_chunk_size,
            vanilla_impl=self.cfg.vanilla_impl,
        )
        if self.causal:
            return vanilla_causal_loss(hidden_BLD, input_ids_BL, head, **kwargs)
        full = self.cfg.mlm_full_logits
        return vanilla_masked_loss(hidden_BLD, labels_BL, head, full_logits=full, **kwargs)

    @staticmethod
    def target_ids(input_ids_BL: torch.Tensor, labels_BL: torch.Tensor | None) -> torch.Tensor:
        """The token ids the loss predicts (K,): next tokens, or the masked originals."""
        if labels_BL is None:
            return input_ids_BL[:, 1:].reshape(-1)
        return labels_BL[labels_BL != -100]
