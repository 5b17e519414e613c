"""What crosses workers: cross-worker negatives and the logged loss.

    negatives_K = gather_negative_ids(target_ids_K)   # all workers' target ids, in rank order
    mean = global_mean(loss_sum)                        # the loss every worker saw, averaged

Both are no-ops in a single process. With cross-worker negatives each worker scores its own
predictions against the embeddings of every worker's targets, read from its own replica of the
embedding table: the gradients stay local and DDP averages them, which equals the gradient of the
single-process loss over the concatenated micro-batches when every worker has the same K.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_negative_ids(target_ids_K: torch.Tensor) -> torch.Tensor:
    """Concatenation of every worker's target ids (masked LMs have different K per worker)."""
    if not _active():
        return target_ids_K
    world = dist.get_world_size()
    size = torch.tensor([target_ids_K.numel()], device=target_ids_K.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.full((longest,), -1, dtype=target_ids_K.dtype, device=target_ids_K.device)
    padded[: target_ids_K.numel()] = target_ids_K
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(n.item())] for g, n in zip(gathered, sizes, strict=True)])


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar over workers (called only at log steps: it synchronises)."""
    if not _active():
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()
