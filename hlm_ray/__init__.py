"""hlm_ray: pretrain, ablate and serve headless language models on Ray.

Headless training (Godey et al., ICLR 2024) replaces the vocabulary projection and softmax by
Contrastive Weight Tying: each output must pick out the input embedding of its true token among
those of the other target positions in the micro-batch. `hlm_ray.objectives.cwt_loss` is the loss
on its own; `hlm train` pretrains with it (or with cross-entropy, the baseline).
"""

__version__ = "0.1.0"
