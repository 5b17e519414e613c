"""Cross-worker negatives on 2 real gloo processes (no Ray): the loss and gradients equal the
single-process CWT loss over the concatenated micro-batches."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hlm_ray.objectives import cwt_loss_from_ids
from hlm_ray.train.distributed import gather_negative_ids, global_mean

V, D = 50, 16


def inputs(sizes):
    gen = torch.Generator().manual_seed(0)
    k = sum(sizes)
    preds = torch.randn(k, D, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 12, (k,), generator=gen)  # many repeats across workers
    table = torch.randn(V, D, generator=gen, dtype=torch.float64)
    return preds, ids, table


def worker(rank, store, sizes, out):
    # A file store, not a TCP port: a port found free can be taken by a parallel test first.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    preds, ids, table = inputs(sizes)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    table = table.requires_grad_()
    negatives = gather_negative_ids(ids[lo:hi])
    assert torch.equal(negatives, ids)  # every worker's targets, in rank order
    loss = cwt_loss_from_ids(preds[lo:hi], ids[lo:hi], table, negative_ids=negatives)
    # Rows weigh K_r / K_total so that the sum over workers is the global mean (DDP averages
    # instead, which is the same when every worker has the same K).
    (loss * (hi - lo) / sum(sizes)).backward()
    dist.all_reduce(table.grad)
    total = (loss.detach() * (hi - lo)).clone()
    dist.all_reduce(total)
    mean = global_mean(torch.tensor(float(rank)))
    if rank == 0:
        out.put((total.item() / sum(sizes), table.grad, mean.item()))
    dist.destroy_process_group()


def test_cross_worker_negatives_equal_the_loss_over_the_concatenated_batches(tmp_path):
    for sizes in ((24, 24), (17, 30)):  # equal K (decoders) and unequal K (masked LMs)
        store = str(tmp_path / f"gloo-store-{sizes[0]}")
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, store, sizes, out)) for r in range(2)]
        for p in procs:
            p.start()
        loss, grad, mean = out.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0

        preds, ids, table = inputs(sizes)
        table.requires_grad_()
        expected = cwt_loss_from_ids(preds, ids, table, variant="plain")
        expected.backward()
        torch.testing.assert_close(torch.tensor(loss, dtype=torch.float64), expected.detach())
        torch.testing.assert_close(grad, table.grad)
        assert mean == 0.5


def test_single_process_is_a_no_op():
    ids = torch.tensor([3, 1, 3])
    assert gather_negative_ids(ids) is ids
    assert global_mean(torch.tensor(2.0)).item() == 2.0
