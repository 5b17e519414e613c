"""What a run counts and saves of the tokens it trained on (hlm_ray.train.token_counts), as
plain functions: a resume continues the checkpoint's sum on rank 0 alone, and a run resumed
from a checkpoint without counts saves none rather than partial counts called exact."""

from types import SimpleNamespace

import numpy as np
import torch

from hlm_ray.train.token_counts import (
    STATE_KEY,
    WHAT,
    restore_counts,
    total_counts,
    write_model_files,
)
from hlm_ray.unigram import COUNTS_FILE, load_counts


def _run(start: int, rank: int = 0, vocab: int = 5):
    cfg = SimpleNamespace(
        objective=SimpleNamespace(name="headless"),
        data=SimpleNamespace(prepared=None, sources=("a.txt", "b.txt")),
        model=SimpleNamespace(family="encoder"),  # no readout.json to fit
    )
    env = SimpleNamespace(is_main=rank == 0, world_size=2)
    counts = torch.zeros(vocab, dtype=torch.long)
    return SimpleNamespace(
        start=start, env=env, target_counts=counts, counts_unknown=False, cfg=cfg, done=start
    )


def test_a_resume_from_a_checkpoint_without_counts_saves_none(tmp_path):
    """Steps 1..50 were trained before counting existed: the counts of 51.. are not the run's,
    so no token_counts.npz is written (the mutant that saved them as exact passed before)."""
    run = _run(start=50)
    restore_counts(run, {"step": 50})
    run.target_counts += torch.tensor([1, 2, 3, 0, 0])  # what steps 51.. counted
    assert run.counts_unknown and total_counts(run) is None
    write_model_files(tmp_path, run, total_counts(run), final=True)
    assert list(tmp_path.iterdir()) == []

    fresh = _run(start=0)  # a fresh start has nothing uncounted
    restore_counts(fresh, {})
    fresh.target_counts += torch.tensor([1, 0, 0, 0, 2])
    assert not fresh.counts_unknown and total_counts(fresh).tolist() == [1, 0, 0, 0, 2]


def test_rank_zero_continues_the_checkpoints_sum_and_the_others_start_from_zero(tmp_path):
    saved = np.array([4, 0, 1, 7, 2])
    main, other = _run(start=30), _run(start=30, rank=1)
    for run in (main, other):
        restore_counts(run, {STATE_KEY: saved})
        assert not run.counts_unknown
    assert main.target_counts.tolist() == saved.tolist() and other.target_counts.sum() == 0
    main.target_counts += torch.tensor([1, 1, 0, 0, 0])
    total = total_counts(main)  # one process: no collective
    assert total.tolist() == [5, 1, 1, 7, 2] and total.dtype == np.int64

    main.done = 40
    write_model_files(tmp_path, main, total, final=False)
    counts, meta = load_counts(tmp_path / COUNTS_FILE)
    assert counts.tolist() == [5, 1, 1, 7, 2]
    assert meta == {
        "vocab_size": 5,
        "tokens": 16,
        "what": WHAT,
        "source": "training",
        "objective": "headless",
        "steps": 40,
        "workers": 2,
        "data": "a.txt,b.txt",
    }
    assert total_counts(SimpleNamespace(target_counts=None)) is None
