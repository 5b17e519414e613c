"""One optimizer step (`hlm_ray.train.step`), called directly on a real tiny run: what it feeds
the objective, what it adds to the log window, DDP's all-reduce on the last micro-batch only,
autocast, loss scaling, gradient clipping, and skipped updates. The objective is wrapped in a
recorder that calls the real one, so every figure below is the run's own."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from types import SimpleNamespace

import pytest
import torch
from tiny_runs import tiny_run_cfg

from hlm_ray.errors import HLMError
from hlm_ray.train import step as step_mod
from hlm_ray.train.inputs import stream_seed
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.run_state import WorkerEnv


class Recorder(torch.nn.Module):
    """The run's objective, called as the step calls it; records each call (the micro-batch,
    the keyword arguments, the loss, whether autocast was on) and each `no_sync` entered (DDP's
    skip of the all-reduce). `poison`: the loss times NaN (a non-finite gradient)."""

    def __init__(self, objective: torch.nn.Module, poison: bool = False):
        super().__init__()
        self.objective, self.poison = objective, poison
        self.calls: list[dict] = []
        self.no_syncs: list[int] = []  # the call index each no_sync was entered before

    def forward(self, input_ids, labels, **kwargs):
        out = self.objective(input_ids, labels, **kwargs)
        loss = out["loss"]
        if self.poison:
            loss = dataclasses.replace(loss, loss=loss.loss * math.nan)
        self.calls.append(
            dict(
                input_ids=input_ids,
                labels=labels,
                kwargs=kwargs,
                loss=float(loss.loss.detach()),
                autocast=torch.is_autocast_enabled("cpu"),
                autocast_dtype=torch.get_autocast_dtype("cpu"),
            )
        )
        return {"loss": loss}

    @contextlib.contextmanager
    def no_sync(self):
        self.no_syncs.append(len(self.calls))
        yield


def tiny_run(tmp_path, preset="tiny-decoder", objective="vanilla", poison=False, **dotted):
    """A real run of `preset` (global batch 8 in micro-batches of 2: 4 per step, one worker)
    with its objective wrapped in a Recorder."""
    from hlm_ray.train.setup import setup_run

    cfg = tiny_run_cfg(tmp_path, preset, objective, steps=4, every=(4, 4, 4), batch=(8, 2),
                       **dotted)  # fmt: skip
    run = setup_run(cfg, None, None, None, None)
    run.module = Recorder(run.module, poison)
    return run


def step_grad_norm(run) -> list[float]:
    """The gradient's norm as the optimizer sees it, at each of its steps (after clipping)."""
    seen = []

    def before_step(optimizer, args, kwargs):
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    run.optimizer.register_step_pre_hook(before_step)
    return seen


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder"])
def test_two_steps_add_their_losses_targets_and_times_to_the_window(tmp_path, preset):
    """Two steps of 4 micro-batches: the window's loss is the sum of each step's micro-batch
    mean, its target counts are the targets the objective saw (next tokens of a decoder, the
    masked originals of an encoder), its time the sum of the steps' times; each micro-batch's
    random stream is its own (seed, step, rank, micro-batch); the gradients are freed after
    the update (set to None, not zeroed: AdamW skips a parameter whose gradient is None)."""
    run = tiny_run(tmp_path, preset)
    assert run.accum == 4
    for step in (0, 1):
        start = time.perf_counter()
        step_mod.train_step(run, step)
        assert 0 < run.step_times[-1] <= time.perf_counter() - start
        assert all(p.grad is None for p in run.model.parameters())
    calls = run.module.calls
    assert len(calls) == 8 and run.window_steps == 2
    per_step = [sum(c["loss"] for c in calls[s * 4 : s * 4 + 4]) / 4 for s in (0, 1)]
    assert float(run.loss_sum) == pytest.approx(sum(per_step), rel=1e-6)
    targets = torch.cat([LMObjective.target_ids(c["input_ids"], c["labels"]) for c in calls])
    expected = torch.bincount(targets, minlength=len(run.target_counts))
    assert torch.equal(run.target_counts, expected)
    assert [c["kwargs"]["negative_seed"] for c in calls] == [
        stream_seed(run.cfg.run.seed, s, 0, i) for s in (0, 1) for i in range(4)
    ]
    assert [c["kwargs"]["negative_ids"] for c in calls] == [None] * 8
    assert len(run.step_times) == 2 and all(t > 0 for t in run.step_times)
    assert run.train_time == pytest.approx(sum(run.step_times))
    assert not any(c["autocast"] for c in calls) and run.module.no_syncs == []


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder"])
def test_cross_worker_negatives_are_the_targets_gathered_from_every_worker(tmp_path, preset):
    """objective.cross_worker_negatives: the objective gets the gathered target ids as its
    negative set (one process: its own targets, a decoder's next tokens or an encoder's
    masked originals) and the step keeps the last micro-batch's for the measured number of
    unique columns."""
    run = tiny_run(tmp_path, preset, "headless", **{"objective.cross_worker_negatives": True})
    step_mod.train_step(run, 0)
    for call in run.module.calls:
        ids, labels = call["input_ids"], call["labels"]
        expected = ids[:, 1:].reshape(-1) if labels is None else labels[labels != -100]
        assert torch.equal(call["kwargs"]["negative_ids"], expected)
    last = run.module.calls[-1]
    assert torch.equal(run.last_batch[2], last["kwargs"]["negative_ids"])
    assert run.last_batch[0] is last["input_ids"] and run.last_batch[1] is last["labels"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_only_the_last_micro_batch_of_a_step_all_reduces(tmp_path, world_size):
    """DDP's gradient all-reduce is skipped (`no_sync`) on every micro-batch of a step but its
    last, so it runs once a step; with one worker there is nothing to skip."""
    run = tiny_run(tmp_path)
    run.env = WorkerEnv(rank=0, world_size=world_size)
    run.accum = 4 // world_size  # this rank's share of the global batch of 8, 2 at a time
    step_mod.train_step(run, 0)
    assert len(run.module.calls) == run.accum
    assert run.module.no_syncs == (list(range(run.accum - 1)) if world_size > 1 else [])


def test_no_sync_is_the_modules_own_and_only_when_asked():
    class DDPLike:
        def no_sync(self):
            return "the module's no_sync"

    assert step_mod._no_sync(DDPLike(), sync=False) == "the module's no_sync"
    assert isinstance(step_mod._no_sync(DDPLike(), sync=True), contextlib.nullcontext)
    assert isinstance(step_mod._no_sync(object(), sync=False), contextlib.nullcontext)


def test_the_forward_runs_under_the_runs_autocast(tmp_path):
    run = tiny_run(tmp_path)
    run.amp = torch.bfloat16
    step_mod.train_step(run, 0)
    assert all(c["autocast"] and c["autocast_dtype"] == torch.bfloat16 for c in run.module.calls)


def test_a_scaled_loss_is_unscaled_before_its_norm_is_taken_and_clipped(tmp_path):
    """fp16's loss scaling (GradScaler, here on the CPU at 2^10): the gradient is unscaled
    before its norm is measured (train/grad_norm) and clipped, so both are the unscaled ones."""
    norms = []
    for scaled in (False, True):
        run = tiny_run(tmp_path / str(scaled), **{"optim.grad_clip": None})
        if scaled:
            run.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        seen = step_grad_norm(run)
        step_mod.train_step(run, 0)
        norms.append((float(run.grad_norm), seen[0]))
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


@pytest.mark.parametrize("clip", [None, 0.0, 1e-3])
def test_the_gradient_is_clipped_to_grad_clip_and_not_clipped_without_it(tmp_path, clip):
    """optim.grad_clip: the optimizer steps on a gradient of norm min(norm, clip); None or 0
    clips nothing. train/grad_norm is the norm before clipping."""
    run = tiny_run(tmp_path, **{"optim.grad_clip": clip})
    seen = step_grad_norm(run)
    step_mod.train_step(run, 0)
    assert run.grad_norm > 1e-3
    assert seen[0] == pytest.approx(clip if clip else float(run.grad_norm), rel=1e-4)


# A skipped step calls the scheduler without the optimizer: torch's warning says so, rightly.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_skipped_updates_leave_the_window_and_the_weights_as_they_were(tmp_path):
    """optim.on_nonfinite=skip, two steps with a NaN gradient: neither update is applied (the
    weights, the window's loss and target counts stay as they were) and both are counted."""
    run = tiny_run(tmp_path, poison=True, **{"optim.on_nonfinite": "skip"})
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    for step in (0, 1):
        step_mod.train_step(run, step)
    assert (run.window_skipped, run.skipped, run.skipped_in_a_row, run.window_steps) == (2, 2, 2, 2)
    assert float(run.loss_sum) == 0 and int(run.target_counts.sum()) == 0
    after = run.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _skip_run(limit: int) -> SimpleNamespace:
    cfg = SimpleNamespace(optim=SimpleNamespace(max_skipped_steps=limit))
    return SimpleNamespace(cfg=cfg, env=WorkerEnv(), grad_norm=math.nan, skipped=0,
                           skipped_in_a_row=0)  # fmt: skip


def test_keep_update_counts_skips_says_which_step_and_stops_past_the_limit(capsys):
    run = _skip_run(limit=2)
    run.skipped = 5  # earlier skips of this attempt, not in a row
    assert step_mod.keep_update(run, 6) is False
    assert step_mod.keep_update(run, 7) is False
    assert (run.skipped, run.skipped_in_a_row) == (7, 2)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "step 7: the gradient is nan; its update is skipped (optim.on_nonfinite=skip; 1 in a row)",
        "step 8: the gradient is nan; its update is skipped (optim.on_nonfinite=skip; 2 in a row)",
    ]
    with pytest.raises(HLMError) as raised:
        step_mod.keep_update(run, 8)
    assert str(raised.value) == (
        "training diverged: the gradient is nan at step 9, 3 steps in a row (steps 7..9), more "
        "than optim.max_skipped_steps=2; the run stops, its last good checkpoint is kept; lower "
        "optim.lr or set optim.grad_clip"
    )
    run.grad_norm = 1.5
    assert step_mod.keep_update(run, 9) is True
    assert (run.skipped, run.skipped_in_a_row) == (8, 0)


def test_a_worker_other_than_the_first_skips_in_silence(capsys):
    run = _skip_run(limit=2)
    run.env = WorkerEnv(rank=1, world_size=2)
    assert step_mod.keep_update(run, 0) is False
    assert capsys.readouterr().err == ""
