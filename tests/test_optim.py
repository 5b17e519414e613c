"""The optimizer: the lazy (row-wise) AdamW of the embedding table against torch's AdamW, clipping
with sparse gradients, its state through a checkpoint, DDP over gloo with sparse gradients, the
guards, one real training run with embedding_update=lazy that resumes exactly, and the fused
AdamW (`adamw`) against torch's per-tensor loop."""

import copy
import io
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

# Light imports only at module level: the DDP test's spawned workers import this module.
from hlm_ray.config import ModelConfig, ObjectiveConfig, OptimConfig
from hlm_ray.errors import HLMError
from hlm_ray.presets import load_config
from hlm_ray.train.optim import LazyAdamW, build_optimizer, clip_grad_norm

V, D = 20, 6
LR, BETAS, EPS = 0.05, (0.9, 0.95), 1e-8


class Toy(nn.Module):
    """An input look-up plus a CWT-like read of target rows: the table's two uses in a step."""

    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, sparse=sparse, dtype=torch.float64)
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.sparse = sparse

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pred = self.lin(self.emb(ids))
        cols = F.embedding(targets, self.emb.weight, sparse=self.sparse)
        return F.cross_entropy(pred @ cols.T, torch.arange(len(ids)))


def optimizer(model: Toy, wd: float) -> torch.optim.Optimizer:
    dense = [model.lin.weight, model.lin.bias]
    if not model.sparse:
        groups = [{"params": [*dense, model.emb.weight], "weight_decay": wd}]
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    groups = [
        {"params": dense, "weight_decay": wd},
        {"params": [model.emb.weight], "weight_decay": wd, "lazy": True},
    ]
    return LazyAdamW(groups, lr=LR, betas=BETAS, eps=EPS)


def batches(steps: int, rows: int, all_rows: bool = False):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, V, (rows,), generator=gen)
        if all_rows:  # every row of the table appears in every step
            ids = torch.cat([torch.randperm(V, generator=gen), ids])
        yield ids, ids.roll(1)


def train(sparse: bool, wd: float, steps: int, rows: int = 5, all_rows: bool = False) -> Toy:
    model = Toy(sparse)
    opt = optimizer(model, wd)
    for ids, targets in batches(steps, rows, all_rows):
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_one_lazy_step_equals_adamw_on_touched_rows_and_leaves_the_rest(wd: float) -> None:
    start = Toy(sparse=False).emb.weight.detach().clone()
    ids, targets = next(batches(1, 5))
    touched = torch.zeros(V, dtype=torch.bool)
    touched[ids] = touched[targets] = True
    assert 0 < touched.sum() < V

    dense, lazy = train(False, wd, 1), train(True, wd, 1)
    torch.testing.assert_close(lazy.emb.weight[touched], dense.emb.weight[touched])
    assert torch.equal(lazy.emb.weight[~touched], start[~touched])  # untouched: unchanged
    # Dense AdamW moves untouched rows only through weight decay on the first step.
    torch.testing.assert_close(dense.emb.weight[~touched], start[~touched] * (1 - LR * wd))
    for name in ("lin.weight", "lin.bias"):  # the dense groups are plain AdamW
        torch.testing.assert_close(lazy.get_parameter(name), dense.get_parameter(name))


def test_rows_touched_every_step_follow_adamw_exactly() -> None:
    dense, lazy = train(False, 0.1, 6, all_rows=True), train(True, 0.1, 6, all_rows=True)
    torch.testing.assert_close(lazy.emb.weight, dense.emb.weight)


def test_untouched_rows_pause_their_momentum_unlike_adamw() -> None:
    # The documented difference: after step 1, dense AdamW keeps moving a row it no longer sees.
    dense, lazy = train(False, 0.0, 3, rows=3), train(True, 0.0, 3, rows=3)
    assert not torch.allclose(lazy.emb.weight, dense.emb.weight)


@pytest.mark.parametrize("scale", [1.0, 1e-6], ids=["usual", "tiny"])
def test_clip_grad_norm_with_sparse_gradients_matches_the_dense_reference(scale) -> None:
    """Also with gradients of norm ~1e-6 (scale), where torch's `total + 1e-6` in the
    denominator is most of the coefficient: the same coefficient as torch's."""
    for max_norm in (0.05 * scale, 1e9):
        sparse, dense = Toy(True), Toy(False)
        ids, targets = next(batches(1, 6))
        (sparse(ids, targets) * scale).backward()
        (dense(ids, targets) * scale).backward()
        assert sparse.emb.weight.grad.is_sparse and not sparse.emb.weight.grad.is_coalesced()
        ours = clip_grad_norm(sparse.parameters(), max_norm)
        ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
        torch.testing.assert_close(ours, ref)
        # Relative only: at scale 1e-6 the gradients are far below the default atol.
        exact = dict(rtol=1e-9, atol=0)
        torch.testing.assert_close(
            sparse.emb.weight.grad.to_dense(), dense.emb.weight.grad, **exact
        )
        torch.testing.assert_close(sparse.lin.weight.grad, dense.lin.weight.grad, **exact)
    assert ref > 0.05 * scale  # the first pass did clip


def test_clip_grad_norm_with_dense_gradients_is_torchs() -> None:
    for max_norm in (0.05, 1e9):
        ours, ref = Toy(False), Toy(False)
        ids, targets = next(batches(1, 6))
        ours(ids, targets).backward()
        ref(ids, targets).backward()
        torch.testing.assert_close(
            clip_grad_norm(ours.parameters(), max_norm),
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm),
        )
        for name, param in ours.named_parameters():
            torch.testing.assert_close(param.grad, ref.get_parameter(name).grad)
    assert clip_grad_norm(Toy(False).parameters(), 1.0) == 0  # no gradient yet: nothing to clip


def test_optimizer_state_survives_a_checkpoint() -> None:
    straight = train(True, 0.1, 4)
    model = Toy(True)
    opt = optimizer(model, 0.1)
    data = list(batches(4, 5))
    for step, (ids, targets) in enumerate(data):
        if step == 2:  # save and rebuild both from bytes, as a resume does
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model = Toy(True)
            model.load_state_dict(saved["model"])
            opt = optimizer(model, 0.1)
            opt.load_state_dict(saved["opt"])
            assert opt.state[model.emb.weight]["step"] == 2
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(model.emb.weight, straight.emb.weight)
    torch.testing.assert_close(model.lin.weight, straight.lin.weight)


# ---- real models ---------------------------------------------------------------------------

TINY = ModelConfig(arch="gpt_neox", hidden_size=16, num_layers=1, num_heads=2, max_positions=16)


def test_headless_step_with_lazy_update_keeps_every_table_gradient_sparse() -> None:
    from hlm_ray.models import build_model, input_embedding_weight
    from hlm_ray.train.lm_objective import LMObjective

    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=300, objective="headless", special_ids={})
    assert model.lm_head.weight is input_embedding_weight(model)  # tied, unused by CWT
    opt = build_optimizer(model, OptimConfig(embedding_update="lazy", weight_decay=0.1))
    assert isinstance(opt, LazyAdamW) and model.get_input_embeddings().sparse
    table = input_embedding_weight(model)
    before = table.detach().clone()
    ids = torch.randint(0, 300, (2, 8))
    LMObjective(model, ObjectiveConfig(name="headless"))(ids)["loss"].loss.backward()
    assert table.grad.is_sparse  # neither the look-up nor the CWT gather made it dense
    clip_grad_norm(model.parameters(), 1.0)
    opt.step()
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[ids.flatten()] = False
    assert torch.equal(table[untouched], before[untouched])
    assert not torch.equal(table[~untouched], before[~untouched])


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2", "bert", "distilbert"])
def test_biases_and_norm_weights_get_no_weight_decay(arch) -> None:
    """Expected by module, not by shape: every LayerNorm parameter and every bias is in a group
    with weight decay 0, every other parameter (linear weights, embedding tables) in one with
    `optim.weight_decay`, each parameter in exactly one group, for both objectives and both
    embedding updates; with `optim.decay_bias_and_norm` every parameter decays."""
    from hlm_ray.models import build_model

    model_cfg = ModelConfig(arch=arch, hidden_size=16, num_layers=1, num_heads=2, max_positions=16)
    cases = itertools.product(("headless", "vanilla"), ("dense", "lazy"), (False, True))
    for objective, update, decay_all in cases:
        if update == "lazy" and objective == "vanilla" and arch != "gpt_neox":
            continue  # a tied vocabulary head: lazy is refused (test_lazy_update_guards)
        model = build_model(model_cfg, vocab_size=50, objective=objective, special_ids={})
        norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm)
                 for p in m.parameters(recurse=False)}  # fmt: skip
        params = dict(model.named_parameters())  # a tied table once
        assert norms and any(name.endswith(".bias") for name in params)
        cfg = OptimConfig(weight_decay=0.1, decay_bias_and_norm=decay_all, embedding_update=update)
        opt = build_optimizer(model, cfg)
        grouped = [(id(p), g["weight_decay"]) for g in opt.param_groups for p in g["params"]]
        assert sorted(i for i, _ in grouped) == sorted(id(p) for p in params.values())
        decay = dict(grouped)
        for name, p in params.items():
            exempt = not decay_all and (id(p) in norms or name.endswith(".bias"))
            assert decay[id(p)] == (0.0 if exempt else 0.1), (objective, update, decay_all, name)


# lr_factor after 4 warm-up steps of 14: steps 4 (the peak), 9 (half-way), 13 (the last), then
# 14 and 20 (past max_steps: the schedule stays at its end).
AFTER_WARMUP = {
    "constant": [1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [1.0, 0.5, 0.1, 0.0, 0.0],
    "cosine": [1.0, 0.5, 0.024471741852423234, 0.0, 0.0],  # (1 + cos(0.9π)) / 2 at step 13
}


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_the_learning_rate_schedule_at_its_edges(schedule) -> None:
    """Optimizer step s (0-based) runs at lr·lr_factor(s): warm-up ramps 1/W, 2/W, ..., 1, so
    the first step already moves and the last warm-up step is at the peak; then the schedule
    from the peak to its end at max_steps. With no warm-up or one step of it, the first step
    runs at the peak. Checked through torch's scheduler, as the loop steps it."""
    from hlm_ray.train.optim import build_scheduler, lr_factor

    cfg = OptimConfig(schedule=schedule, warmup_steps=4, max_steps=14)
    assert [lr_factor(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    after = [lr_factor(s, cfg) for s in (4, 9, 13, 14, 20)]
    assert after == pytest.approx(AFTER_WARMUP[schedule], abs=1e-12)
    for warmup in (0, 1):
        short = OptimConfig(schedule=schedule, warmup_steps=warmup, max_steps=14)
        assert lr_factor(0, short) == 1.0
    one_after = OptimConfig(schedule=schedule, warmup_steps=4, max_steps=5)  # a span of 1 step
    assert lr_factor(5, one_after) == (1.0 if schedule == "constant" else 0.0)
    weight = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([weight], lr=2.0)
    scheduler = build_scheduler(opt, cfg)
    seen = []
    for _ in range(15):
        seen.append(opt.param_groups[0]["lr"])  # the lr this optimizer step runs at
        opt.step()
        scheduler.step()
    expected = [0.25, 0.5, 0.75, 1.0] + [lr_factor(s, cfg) for s in range(4, 15)]
    assert seen == pytest.approx([2.0 * f for f in expected], abs=1e-12)
    assert seen[9] == pytest.approx(2.0 * AFTER_WARMUP[schedule][1])


def test_lazy_adamw_groups_are_dense_unless_marked_and_lazy_ones_refuse_amsgrad_or_maximize():
    """A group is lazy only when it says so (those built with the optimizer and those added
    later); a lazy group refuses amsgrad and maximize, each on its own, in words."""
    model = Toy(True)
    opt = LazyAdamW([{"params": [model.lin.weight]}], lr=LR)
    opt.add_param_group({"params": [model.lin.bias]})
    opt.add_param_group({"params": [model.emb.weight], "lazy": True})
    assert [g["lazy"] for g in opt.param_groups] == [False, False, True]
    assert all(type(g["lazy"]) is bool for g in opt.param_groups)
    for flag in ("amsgrad", "maximize"):
        with pytest.raises(ValueError) as err:
            LazyAdamW([{"params": [model.emb.weight], "lazy": True, flag: True}], lr=LR)
        assert str(err.value) == "lazy parameter groups support neither amsgrad nor maximize"
    LazyAdamW([{"params": [model.lin.weight], "amsgrad": True, "maximize": True}], lr=LR)


def test_lazy_update_guards() -> None:
    from hlm_ray.models import build_model

    lazy = OptimConfig(embedding_update="lazy")
    gpt2 = build_model(
        ModelConfig(arch="gpt2", hidden_size=16, num_layers=1, num_heads=2, max_positions=16),
        vocab_size=50,
        objective="vanilla",
        special_ids={},
    )
    with pytest.raises(HLMError, match="tied"):
        build_optimizer(gpt2, lazy)
    # A vanilla GPT-NeoX has an untied head: its input table can be lazy, its head stays dense.
    neox = build_model(TINY, vocab_size=50, objective="vanilla", special_ids={})
    assert isinstance(build_optimizer(neox, lazy), LazyAdamW)
    with pytest.raises(HLMError, match="embedding_update"):
        load_config("tiny-encoder", objective="vanilla", overrides=["optim.embedding_update=lazy"])
    assert load_config("tiny-encoder", overrides=["optim.embedding_update=lazy"])


def test_the_optimizer_carries_the_configs_settings_and_refuses_each_case_in_words(
    monkeypatch,
) -> None:
    """lr, betas and eps reach the optimizer (dense, lazy, and lazy with a frozen table); only
    the table's group is lazy; each refusal says what was wrong and what to use instead."""
    import torch.distributed as torch_dist

    from hlm_ray.models import build_model
    from hlm_ray.train.optim import adamw, uses_sparse_embedding

    cfg = dict(lr=0.02, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for update, frozen in (("dense", False), ("lazy", False), ("lazy", True)):
        model = build_model(TINY, vocab_size=50, objective="headless", special_ids={})
        model.get_input_embeddings().weight.requires_grad_(not frozen)
        opt = build_optimizer(model, OptimConfig(embedding_update=update, **cfg))
        assert isinstance(opt, LazyAdamW) == (update == "lazy" and not frozen)
        assert uses_sparse_embedding(model) == (update == "lazy" and not frozen)
        for group in opt.param_groups:
            assert (group["lr"], group["betas"], group["eps"]) == (0.02, (0.8, 0.9), 1e-6)
        lazy_flags = [g["lazy"] for g in opt.param_groups if "lazy" in g]
        table_lazy = update == "lazy" and not frozen
        assert lazy_flags == [False, False] + ([True] if table_lazy else []), (update, frozen)
        grouped = {id(p) for g in opt.param_groups for p in g["params"]}
        table = model.get_input_embeddings().weight
        assert (id(table) in grouped) == (not frozen)
        assert len(grouped) == sum(p.requires_grad for p in model.parameters())

    class NoTable(nn.Module):
        def get_input_embeddings(self):
            return nn.Linear(2, 2)

    assert uses_sparse_embedding(NoTable()) is False
    on_meta = nn.Linear(2, 2, device="meta")  # no fused kernel there: torch's own loop
    assert not adamw([{"params": list(on_meta.parameters())}]).defaults["fused"]
    assert adamw([{"params": [nn.Parameter(torch.zeros(2))]}]).defaults["fused"]

    lazy = OptimConfig(embedding_update="lazy")
    mixed = build_model(
        ModelConfig(arch="gpt2", hidden_size=16, num_layers=1, num_heads=2, max_positions=16),
        vocab_size=50, objective="mixed", special_ids={},
    )  # fmt: skip
    tied = (
        "optim.embedding_update=lazy: this model's vocabulary head is tied to the input "
        "embedding, so every step writes all its rows; use optim.embedding_update=dense "
        "(lazy suits headless models and vanilla gpt_neox, whose head is untied)"
    )
    with pytest.raises(HLMError) as err:
        build_optimizer(mixed, lazy)
    assert str(err.value) == tied

    with pytest.raises(HLMError) as err:
        build_optimizer(NoTable(), lazy)
    assert str(err.value) == (
        "optim.embedding_update=lazy needs an nn.Embedding input table, not Linear; "
        "use optim.embedding_update=dense"
    )
    # Several workers: gloo averages sparse gradients, another backend (NCCL) cannot.
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    for world, backend, refused in ((2, "nccl", True), (2, "gloo", False), (1, "nccl", False)):
        monkeypatch.setattr(torch_dist, "get_world_size", lambda world=world: world)
        monkeypatch.setattr(torch_dist, "get_backend", lambda backend=backend: backend)
        model = build_model(TINY, vocab_size=50, objective="headless", special_ids={})
        if not refused:
            assert isinstance(build_optimizer(model, lazy), LazyAdamW)
            continue
        with pytest.raises(HLMError) as err:
            build_optimizer(model, lazy)
        assert str(err.value) == (
            "optim.embedding_update=lazy sends sparse gradients, which the nccl backend cannot "
            "average; use optim.embedding_update=dense with several GPUs (gloo, on CPU workers, "
            "supports it)"
        )


# ---- DDP over gloo -------------------------------------------------------------------------


def ddp_worker(rank: int, store: str, out) -> None:
    # A file store, not a TCP port: a port found free here can be taken by a parallel test
    # before rank 0 listens on it (EADDRINUSE, seen in the full suite).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = Toy(sparse=True)
    opt = optimizer(model, 0.1)
    ddp = nn.parallel.DistributedDataParallel(model)
    data = list(batches(4, 5))
    for step in range(2):
        ids, targets = data[2 * step + rank]
        ddp(ids, targets).backward()  # DDP averages the sparse gradients of the two workers
        clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        out.put(model.emb.weight.detach().tolist())  # plain data: no shared-memory handle
    dist.barrier()  # both ranks done before either tears gloo down (an abort at exit otherwise)
    dist.destroy_process_group()


def test_ddp_averages_sparse_gradients_over_gloo(tmp_path) -> None:
    # The single-process reference: each step's loss is the mean over both workers' batches.
    model = Toy(sparse=True)
    opt = optimizer(model, 0.1)
    data = list(batches(4, 5))
    for step in range(2):
        for rank in range(2):
            (model(*data[2 * step + rank]) / 2).backward()
        clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "gloo-store")
    procs = [ctx.Process(target=ddp_worker, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    weight = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    torch.testing.assert_close(torch.tensor(weight, dtype=torch.float64), model.emb.weight.detach())


# ---- the training loop ---------------------------------------------------------------------


def test_training_with_lazy_update_resumes_exactly(tmp_path) -> None:
    from safetensors.torch import load_file
    from tiny_runs import tiny_run_cfg

    from hlm_ray.train.loop import train_worker

    small = {"data.max_tokens": 40_000, "model.hidden_size": 32, "model.num_layers": 1}
    lazy = {"optim.embedding_update": "lazy", "optim.warmup_steps": 1, "run.eval_batches": 1}

    def cfg(out, steps):
        return tiny_run_cfg(
            out, steps=steps, every=(2, 100, 2), vocab=300, **small, **lazy
        ).to_dict()

    straight = train_worker(cfg(tmp_path / "a", 4), progress=False)
    assert torch.isfinite(torch.tensor(straight["metrics"]["train/loss"]))
    resumed = tmp_path / "b"
    train_worker(
        cfg(resumed, 4), progress=False, resume_from=tmp_path / "a" / "checkpoint_00000002"
    )
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(resumed / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key)


# ---- fused AdamW ---------------------------------------------------------------------------


def _steps(opt_of, dtype: torch.dtype, steps: int = 5) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50)).to(dtype)
    opt = opt_of([{"params": list(model.parameters()), "weight_decay": 0.1}])
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 50, (16,), generator=gen)
        logits = model(ids).float() * 30  # large logits: gradients far from tiny
        F.cross_entropy(logits, ids.roll(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_adamw_is_fused_on_cpu_and_matches_the_loop() -> None:
    from hlm_ray.train.optim import adamw

    kw = dict(lr=LR, betas=BETAS, eps=EPS)
    fused, opt = _steps(lambda g: adamw(g, **kw), torch.float32)
    assert opt.defaults["fused"] is True
    loop, ref = _steps(lambda g: torch.optim.AdamW(g, foreach=False, **kw), torch.float32)
    assert not ref.defaults["fused"]
    for a, b in zip(fused.parameters(), loop.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_fused_adamw_on_bf16_weights_rounds_the_exact_update_once() -> None:
    # bf16 weights: the fused kernel computes the update in float and rounds once, so it
    # equals the float64 update of the same weights and gradient, rounded to bf16 (the loop
    # rounds after every op and can be several bf16 steps off).
    from hlm_ray.train.optim import adamw

    kw = dict(lr=LR, betas=BETAS, eps=EPS)
    model, _ = _steps(lambda g: adamw(g, **kw), torch.bfloat16, steps=0)
    exact = [p.detach().double().requires_grad_() for p in model.parameters()]
    ids = torch.arange(16)
    (F.cross_entropy(model(ids).float() * 30, ids.roll(1))).backward()
    for e, p in zip(exact, model.parameters(), strict=True):
        e.grad = p.grad.double()
    adamw([{"params": list(model.parameters()), "weight_decay": 0.1}], **kw).step()
    torch.optim.AdamW([{"params": exact, "weight_decay": 0.1}], foreach=False, **kw).step()
    for p, e in zip(model.parameters(), exact, strict=True):
        # One bf16 rounding of the exact result: within half a bf16 step (2^-8 relative).
        torch.testing.assert_close(p.double(), e.detach(), atol=1e-6, rtol=2**-8)


def test_a_loop_adamw_checkpoint_resumes_into_the_fused_one() -> None:
    # Run folders written before the optimizer was fused resume with it, state and all.
    from hlm_ray.train.optim import adamw

    kw = dict(lr=LR, betas=BETAS, eps=EPS)
    model, ref = _steps(lambda g: torch.optim.AdamW(g, foreach=False, **kw), torch.float32, 2)
    state = copy.deepcopy(ref.state_dict())  # the loop's own step below must not touch it
    fused = adamw([{"params": list(model.parameters()), "weight_decay": 0.1}], **kw)
    fused.load_state_dict(state)
    ids = torch.arange(16)
    for opt in (ref, fused):  # the same gradient through both; the fused one runs second
        before = [p.detach().clone() for p in model.parameters()]
        F.cross_entropy(model(ids), ids.roll(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        moved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, b in zip(model.parameters(), before, strict=True):
                p.copy_(b)
        if opt is ref:
            expected = moved
    for got, want in zip(moved, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert fused.state_dict()["state"][0]["step"] == 3
