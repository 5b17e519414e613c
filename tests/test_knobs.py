"""Every ablation setting reaches the loss through the real training loop (in process, no Ray).

An ablation platform promises that the swept value, and nothing else, changes between runs.
Each test trains 1-4 tiny steps through `train_worker`, reads step 1's logged loss and checks it
against the loss function of `hlm_ray.objectives` applied by hand, with that value, to the same
first batch and the same initial weights (`knobs_common.first_step` rebuilds them). Settings
that must not change the result (chunking, dedup vs plain, the CE implementation) must equal
the default run's loss, and are seen reaching the loss function by a spy on it.
Cross-worker negatives (two gloo processes) are in test_knobs_distributed.py.
"""

import math

import pytest
import torch
from knobs_common import (
    by_hand,
    ce,
    cwt,
    differs,
    first_step,
    knob_cfg,
    logged_losses,
    spy,
    train_losses,
)
from transformers import AutoModelForCausalLM

from hlm_ray.models import input_embedding_weight
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train import loop
from hlm_ray.train.loop import train_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def knob_cache(tmp_path_factory):
    """One HLM cache for the module: each prepared corpus (BPE + token blocks) is made once."""
    return tmp_path_factory.mktemp("knob_cache")


@pytest.fixture(autouse=True)
def _shared_cache(_hlm_cache_dir, knob_cache, monkeypatch):
    monkeypatch.setenv("HLM_CACHE_DIR", str(knob_cache))


@pytest.fixture(scope="module")
def default_losses(tmp_path_factory, knob_cache):
    """Step 1's loss of the default run of (preset, objective), trained once per module."""
    seen: dict[tuple[str, str], float] = {}

    def get(preset: str, objective: str) -> float:
        if (preset, objective) not in seen:
            out = tmp_path_factory.mktemp(f"default-{preset}-{objective}")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("HLM_CACHE_DIR", str(knob_cache))
                seen[preset, objective] = train_losses(knob_cfg(out, preset, objective))[0]
        return seen[preset, objective]

    return get


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder"])
def test_objective_temperature_reaches_the_loss(preset, tmp_path, default_losses):
    cfg = knob_cfg(tmp_path, preset, **{"objective.temperature": 0.05})
    logged = train_losses(cfg)[0]
    start = first_step(cfg)
    expected = by_hand(start, lambda x, labels, seed: cwt(start, x, labels, temperature=0.05))
    assert logged == pytest.approx(float(expected), rel=1e-5)
    assert differs(logged, default_losses(preset, "headless")), logged


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder"])
def test_objective_num_negatives_reaches_the_loss(preset, tmp_path, default_losses):
    """N sampled negatives, drawn with the generator seeded by (seed, step, rank, micro)."""
    cfg = knob_cfg(tmp_path, preset, **{"objective.num_negatives": 16})
    logged = train_losses(cfg)[0]
    start = first_step(cfg)

    def sampled(seed_of):
        return float(
            by_hand(
                start,
                lambda x, labels, seed: cwt(
                    start,
                    x,
                    labels,
                    num_negatives=16,
                    generator=torch.Generator().manual_seed(seed_of(seed)),
                ),
            )
        )

    assert logged == pytest.approx(sampled(lambda seed: seed), rel=1e-5)
    # The seed matters: another draw of the 16 negatives gives another loss.
    assert differs(logged, sampled(lambda seed: seed + 1), rel=1e-4)
    assert differs(logged, default_losses(preset, "headless")), logged
    assert abs(logged - math.log(17)) < 1.0  # 1 positive among 17 columns, at initialisation


def test_objective_num_negatives_seeding_survives_a_resume(tmp_path):
    """Same seed, step and rank give the same sampled negatives, also after a resume."""
    extra = {"objective.num_negatives": 16, "optim.max_steps": 4, "run.checkpoint_every": 2}
    full = train_losses(knob_cfg(tmp_path / "full", **extra))
    broken = knob_cfg(tmp_path / "broken", **extra, **{"run.fail_at_step": 2})
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        train_worker(broken.to_dict(), progress=False)
    last = ckpt.list_checkpoints(tmp_path / "broken")[-1]
    assert ckpt.checkpoint_step(last) == 2
    train_worker(broken.to_dict(), resume_from=last, progress=False)
    resumed = logged_losses(tmp_path / "broken")
    assert len(full) == len(resumed) == 4
    assert resumed == pytest.approx(full, rel=1e-6)


def test_every_step_masks_and_samples_anew_and_a_resume_draws_the_same(tmp_path, monkeypatch):
    """An encoder with sampled negatives, fed the same blocks at every step (so only the random
    stream can differ): each step masks other positions and samples other negative rows than
    the step before (one stream per step, not one per run), and a run resumed from step 2's
    checkpoint draws exactly what the straight run drew at steps 3-4."""
    from hlm_ray import objectives
    from hlm_ray.train import step as step_mod

    drawn: dict[str, dict] = {}  # run -> {(step, micro): [masked positions, negative rows]}
    current: list = [None, None]  # [run, (step, micro)] of the micro-batch in the loop
    first_idx: dict[int, torch.Tensor] = {}  # micro -> the blocks of step 0's micro-batch
    real_load, real_seed = step_mod.load_batch, step_mod.stream_seed
    real_sample = objectives.sample_negative_rows

    def load_batch(blocks, idx, env, masking, seed, step, micro):
        idx = first_idx.setdefault(micro, idx)
        input_ids, labels = real_load(blocks, idx, env, masking, seed, step, micro)
        drawn[current[0]][step, micro] = [labels != -100, None]
        return input_ids, labels

    def stream_seed(seed, step, rank, micro):  # the train step's, just before the forward
        current[1] = (step, micro)
        return real_seed(seed, step, rank, micro)

    def sample_negative_rows(num_rows, num_negatives, generator):
        rows = real_sample(num_rows, num_negatives, generator)
        if current[1] is not None:  # a validation batch's draw is not recorded
            drawn[current[0]][current[1]][1] = rows
            current[1] = None
        return rows

    monkeypatch.setattr(step_mod, "load_batch", load_batch)
    monkeypatch.setattr(step_mod, "stream_seed", stream_seed)
    monkeypatch.setattr(objectives, "sample_negative_rows", sample_negative_rows)
    extra = {"objective.num_negatives": 16, "optim.max_steps": 4, "run.checkpoint_every": 2}
    for run in ("full", "resumed"):
        cfg = knob_cfg(tmp_path / run, "tiny-encoder", **extra)
        current[0], drawn[run] = run, {}
        if run == "full":
            train_worker(cfg.to_dict(), progress=False)
            continue
        [folder] = [
            f for f in ckpt.list_checkpoints(tmp_path / "full") if ckpt.checkpoint_step(f) == 2
        ]
        train_worker(cfg.to_dict(), resume_from=folder, progress=False)
    full, resumed = drawn["full"], drawn["resumed"]
    assert sorted(full) == [(s, m) for s in range(4) for m in range(2)]
    assert sorted(resumed) == [(s, m) for s in (2, 3) for m in range(2)]
    for (step, micro), (mask, rows) in full.items():
        assert mask.any() and rows is not None and len(rows) == 16
        if step:
            before_mask, before_rows = full[step - 1, micro]
            assert not torch.equal(mask, before_mask), (step, micro)
            assert not torch.equal(rows, before_rows), (step, micro)
    for key, (mask, rows) in resumed.items():
        assert torch.equal(mask, full[key][0]) and torch.equal(rows, full[key][1]), key


def test_objective_cwt_chunk_size_reaches_the_loss(tmp_path, default_losses, monkeypatch):
    """Chunking is exact: the default's loss, computed in chunks of 100 rows (K = 1008)."""
    calls = spy(monkeypatch, "cwt_loss_from_ids")
    cfg = knob_cfg(tmp_path, **{"objective.cwt_chunk_size": 100})
    logged = train_losses(cfg)[0]
    seen = [c["chunk_size"] for c in calls]
    assert seen and set(seen) == {100}, seen
    assert logged == pytest.approx(default_losses("tiny-decoder", "headless"), rel=1e-5)
    start = first_step(cfg)
    expected = by_hand(start, lambda x, labels, seed: cwt(start, x, labels, chunk_size=100))
    assert logged == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("variant", ["plain", "mask_same"])
def test_objective_cwt_variant_reaches_the_loss(variant, tmp_path, default_losses, monkeypatch):
    """plain equals the default (dedup); mask_same is another objective."""
    calls = spy(monkeypatch, "cwt_loss_from_ids")
    cfg = knob_cfg(tmp_path, **{"objective.cwt_variant": variant})
    logged = train_losses(cfg)[0]
    seen = [c["variant"] for c in calls]
    assert seen and set(seen) == {variant}, seen
    start = first_step(cfg)
    expected = by_hand(start, lambda x, labels, seed: cwt(start, x, labels, variant=variant))
    assert logged == pytest.approx(float(expected), rel=1e-5)
    default = default_losses("tiny-decoder", "headless")
    if variant == "plain":
        assert logged == pytest.approx(default, rel=1e-5)
    else:  # repeated tokens are no longer negatives of each other: a lower loss
        assert logged < default and differs(logged, default), (logged, default)


@pytest.mark.parametrize("impl", ["chunked", "linear"])
def test_objective_ce_impl_and_chunk_size_reach_the_loss(
    impl, tmp_path, default_losses, monkeypatch
):
    """The vanilla head's implementations give the full one's loss; 100 rows a chunk."""
    calls = spy(monkeypatch, "cross_entropy_head")
    cfg = knob_cfg(
        tmp_path, objective="vanilla", **{"objective.ce_impl": impl, "objective.ce_chunk_size": 100}
    )
    logged = train_losses(cfg)[0]
    seen = {(c["impl"], c["chunk_size"]) for c in calls}
    assert seen == {(impl, 100)}, seen
    assert logged == pytest.approx(default_losses("tiny-decoder", "vanilla"), rel=1e-5)
    start = first_step(cfg)
    expected = by_hand(
        start, lambda x, labels, seed: ce(start, x, labels, impl=impl, chunk_size=100)
    )
    assert logged == pytest.approx(float(expected), rel=1e-5)


def test_objective_mixed_weights_reach_the_loss(tmp_path, default_losses):
    """The mixed objective: cwt_weight × CWT + ce_weight × CE of the same rows."""
    weights = {"objective.cwt_weight": 0.5, "objective.ce_weight": 2.0}
    cfg = knob_cfg(tmp_path, objective="mixed", **weights)
    logged = train_losses(cfg)[0]
    start = first_step(cfg)
    cwt_part = by_hand(start, lambda x, labels, seed: cwt(start, x, labels))
    ce_part = by_hand(start, lambda x, labels, seed: ce(start, x, labels))
    assert logged == pytest.approx(float(0.5 * cwt_part + 2.0 * ce_part), rel=1e-5)
    assert differs(logged, default_losses("tiny-decoder", "mixed")), logged


def test_tokenizer_vocab_size_reaches_the_loss(tmp_path, default_losses):
    """What sweeps/vocab.py varies: the BPE's size is the model's vocabulary, and the vanilla
    loss at initialisation is about log V."""
    cfg = knob_cfg(tmp_path, objective="vanilla", **{"tokenizer.vocab_size": 384})
    summary = train_worker(cfg.to_dict(), progress=False)
    logged = logged_losses(tmp_path)[0]
    start = first_step(cfg)
    assert summary["vocab_size"] == len(start.tokenizer) == 384
    expected = by_hand(start, lambda x, labels, seed: ce(start, x, labels))
    assert logged == pytest.approx(float(expected), rel=1e-5)
    assert abs(logged - math.log(384)) < 0.5
    assert differs(logged, default_losses("tiny-decoder", "vanilla")), logged


def test_optim_micro_batch_size_reaches_the_loss(tmp_path, default_losses):
    """What sweeps/batch_size.py varies: K comes from the micro-batch (8 sequences, 4 of them
    per step of 32), so the CWT loss changes with it."""
    cfg = knob_cfg(tmp_path, **{"optim.micro_batch_size": 8})
    logged = train_losses(cfg)[0]
    start = first_step(cfg)
    assert [len(x) for x, _, _ in start.micro_batches] == [8, 8, 8, 8]
    expected = by_hand(start, lambda x, labels, seed: cwt(start, x, labels))
    assert logged == pytest.approx(float(expected), rel=1e-5)
    assert differs(logged, default_losses("tiny-decoder", "headless")), logged


def test_optim_global_batch_size_reaches_the_loss(tmp_path):
    """16 sequences a step: one micro-batch, the first half of the default's step. At a low
    temperature the loss depends on the batch's content enough to tell the two apart."""
    sharp = {"objective.temperature": 0.05}
    cfg = knob_cfg(tmp_path, **sharp, **{"optim.global_batch_size": 16})
    logged = train_losses(cfg)[0]
    start = first_step(cfg)
    assert len(start.micro_batches) == 1
    expected = by_hand(start, lambda x, labels, seed: cwt(start, x, labels, temperature=0.05))
    assert logged == pytest.approx(float(expected), rel=1e-5)
    default = first_step(knob_cfg(tmp_path / "default", **sharp))  # global batch 32
    assert len(default.micro_batches) == 2
    other = by_hand(default, lambda x, labels, seed: cwt(default, x, labels, temperature=0.05))
    assert differs(logged, float(other)), (logged, float(other))


def test_optim_embedding_update_reaches_the_update(tmp_path):
    """The first step's loss is the same for both; the update is not. By hand: dense AdamW
    moves every row of the embedding table (weight decay shrinks the rows no token of the step
    touched), the lazy update moves only the touched rows, exactly as AdamW does them."""
    # A strong weight decay: untouched rows shrink by lr·wd = 0.3% in the dense update.
    extra = {"optim.warmup_steps": 0, "optim.weight_decay": 1.0}
    tables = {}
    for update in ("dense", "lazy"):
        cfg = knob_cfg(tmp_path / update, **extra, **{"optim.embedding_update": update})
        summary = train_worker(cfg.to_dict(), progress=False)
        model = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
        tables[update] = input_embedding_weight(model).detach()

    start = first_step(cfg)
    loss = by_hand(start, lambda x, labels, seed: cwt(start, x, labels), grad=True)
    loss.backward()
    params = [p for p in start.model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
    weight_VD = input_embedding_weight(start.model)
    before_VD = weight_VD.detach().clone()
    o = cfg.optim
    adamw = torch.optim.AdamW([weight_VD], lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=1.0)
    adamw.step()
    dense_VD = weight_VD.detach()
    touched_V = weight_VD.grad.abs().sum(dim=1) > 0
    lazy_VD = torch.where(touched_V[:, None], dense_VD, before_VD)
    assert 0 < int(touched_V.sum()) < len(touched_V)

    torch.testing.assert_close(tables["dense"], dense_VD)
    torch.testing.assert_close(tables["lazy"], lazy_VD)
    assert not torch.equal(tables["dense"][~touched_V], tables["lazy"][~touched_V])


def test_best_checkpoint_has_the_lowest_validation_loss_also_after_a_resume(tmp_path, monkeypatch):
    """Validation every step; the loss of step s is scripted (the real evaluation runs, its
    val/loss is replaced) so that the best is neither the last nor the newest before a resume.
    The run is interrupted after step 4 and after step 6, and resumed each time."""
    scripted = {1: 5.0, 2: 3.0, 3: 4.0, 4: 6.0, 5: 3.5, 6: 4.5, 7: 2.5, 8: 2.8}
    real = loop.evaluate

    def evaluate(module, val_blocks, cfg, *args):
        metrics = real(module, val_blocks, cfg, *args)
        done = sum(1 for r in logged_losses(cfg.run.output_dir))  # steps logged so far
        return {**metrics, "val/loss": scripted[done]}

    monkeypatch.setattr(loop, "evaluate", evaluate)
    extra = {"optim.max_steps": 8, "run.eval_every": 1, "run.checkpoint_every": 1}
    root = tmp_path / "run"

    def best():
        folder = root / loop.BEST
        return ckpt.checkpoint_step(folder), ckpt.load_train_state(folder)["metrics"]["val/loss"]

    for fail_at, best_then in ((4, (2, 3.0)), (6, (2, 3.0)), (None, (7, 2.5))):
        cfg = knob_cfg(root, **extra, **{"run.fail_at_step": fail_at})
        resume = ckpt.list_checkpoints(root)[-1] if fail_at != 4 else None
        if fail_at is None:
            train_worker(cfg.to_dict(), progress=False, resume_from=resume)
        else:
            with pytest.raises(RuntimeError, match=f"injected failure at step {fail_at}"):
                train_worker(cfg.to_dict(), progress=False, resume_from=resume)
        assert best() == best_then, fail_at
    # The newest checkpoints were pruned to run.keep_checkpoints; the best survived them.
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(root)] == [7, 8]
    assert ckpt.verify(root / loop.BEST) is None
