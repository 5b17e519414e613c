"""`objective.cross_worker_negatives` reaches the loss: the real `train_worker` on two gloo
processes (torch.multiprocessing, no Ray), step 1's logged loss against the CWT loss applied by
hand to each worker's micro-batch with every worker's targets as negatives."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from knobs_common import by_hand, cwt, differs, first_step, knob_cfg, logged_losses

from hlm_ray.prepare import ensure_prepared
from hlm_ray.train.loop import WorkerEnv, train_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rank(rank: int, store: str, config: dict) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP port: a port found free can be taken by a parallel test first.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        train_worker(config, env=WorkerEnv(rank=rank, world_size=2), progress=False)
    finally:
        dist.destroy_process_group()


def test_objective_cross_worker_negatives_reaches_the_loss(tmp_path):
    # Global batch 32 = one micro-batch of 16 per worker: rank r's is the default's r-th.
    cfg = knob_cfg(tmp_path / "run", **{"objective.cross_worker_negatives": True})
    ensure_prepared(cfg, progress=False)  # once, before two processes read it
    store, ctx = str(tmp_path / "gloo-store"), mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, store, cfg.to_dict())) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():  # a hung collective: do not leave it behind
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    logged = logged_losses(tmp_path / "run")[0]

    starts = [first_step(cfg, rank=r, world_size=2) for r in range(2)]
    (x0, _, _), (x1, _, _) = (s.micro_batches[0] for s in starts)
    negatives_K = torch.cat([x0[:, 1:].reshape(-1), x1[:, 1:].reshape(-1)])  # rank order
    crossed, own = [], []
    for st in starts:
        assert len(st.micro_batches) == 1
        crossed.append(by_hand(st, lambda x, y, _, st=st: cwt(st, x, y, negative_ids=negatives_K)))
        own.append(by_hand(st, lambda x, y, _, st=st: cwt(st, x, y)))
    expected, without = float(sum(crossed) / 2), float(sum(own) / 2)  # the loop's global mean
    assert logged == pytest.approx(expected, rel=1e-5)
    assert differs(logged, without), (logged, without)  # 2K negatives instead of K: higher
