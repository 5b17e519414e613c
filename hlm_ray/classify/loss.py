"""Fine-tuning losses: the paper's balanced cross-entropy, plain cross-entropy, and MSE.

    from hlm_ray.classify.loss import LOSSES, balanced_cross_entropy
    loss = balanced_cross_entropy(logits_BC, labels_B)     # the paper's GLUE default
    loss = LOSSES["ce"](logits_BC, labels_B)

Balanced cross-entropy (paper, Appendix B.1): with L_c the summed cross-entropy of the batch's
class-c examples and w_c the frequency of class c, estimated from the batch labels,

    L_bce = sum_c L_c / w_c.

With w_c = n_c (the class's count in the batch) every present class contributes its *mean*
cross-entropy with equal weight. hlm_ray divides by the number of classes C (a constant, so the
optimisation is the paper's up to a fixed scale; AdamW is insensitive to it):

    loss = (1 / C) * sum_{c present} (1 / n_c) * sum_{i : y_i = c} CE_i

It equals plain cross-entropy when the batch is balanced (n_c = B / C for every c). Dividing by
the number of classes *present* instead would weigh a one-class batch twice as much as the
paper's formula does, so the constant C is used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def balanced_cross_entropy(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with each example's loss divided by its class's count in the batch,
    summed, then divided by the number of classes C (see the module docstring)."""
    logits_BC = logits_BC.float()  # softmax statistics in float32 whatever the model ran in
    num_classes = logits_BC.shape[-1]
    ce_B = F.cross_entropy(logits_BC, labels_B, reduction="none")
    counts_C = torch.bincount(labels_B, minlength=num_classes).to(ce_B.dtype)
    weights_B = 1.0 / counts_C[labels_B]  # an example's class is present: count >= 1
    return (ce_B * weights_B).sum() / num_classes


def plain_cross_entropy(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BC.float(), labels_B)


def regression_mse(scores_B1: torch.Tensor, targets_B: torch.Tensor) -> torch.Tensor:
    """STS-B: mean squared error of the single output against the gold score."""
    return F.mse_loss(scores_B1.float().squeeze(-1), targets_B.float())


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "balanced": balanced_cross_entropy,
    "ce": plain_cross_entropy,
}
