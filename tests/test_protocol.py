"""The protocol details that move scores, each against a hand computation: validation bits per
byte without EOS, budgets in compute, the clm recipes, encoder blocks [CLS] ... [SEP]."""

import math

import pytest
import torch

from hlm_ray.config import Config, apply_overrides
from hlm_ray.errors import HLMError
from hlm_ray.models import build_model
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.loop import WorkerEnv
from hlm_ray.train.validate import evaluate

# ----------------------------------------------------------------------------- val/token_bpb


def test_val_token_bpb_leaves_eos_out_as_evaluate_bpb_does():
    eos, vocab = 0, 40
    cfg = apply_overrides(
        Config(),
        {
            "objective.name": "vanilla",
            "model.hidden_size": 16,
            "model.num_heads": 2,
            "data.seq_len": 8,
            "optim.micro_batch_size": 2,
            "optim.global_batch_size": 2,
            "run.eval_batches": 2,
        },
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=vocab, objective="vanilla", special_ids={})
    model.eval()
    token_bytes = torch.randint(1, 5, (vocab,))
    token_bytes[eos] = 0  # EOS stands for no text
    blocks = torch.randint(1, vocab, (4, 8))
    blocks[0, 3] = blocks[1, 0] = blocks[2, 7] = blocks[3, 5] = eos  # documents end mid-block
    val = evaluate(
        LMObjective(model, cfg.objective), blocks, cfg, WorkerEnv(), None, token_bytes, None
    )

    # By hand: -log p of every next token that is not EOS, over the bytes of those tokens.
    nats, num_bytes, ce_all = 0.0, 0, 0.0
    with torch.no_grad():
        logprobs = model(input_ids=blocks).logits.double().log_softmax(-1)
    for b in range(4):
        for t in range(7):
            target = int(blocks[b, t + 1])
            ce_all -= logprobs[b, t, target].item()
            if target != eos:
                nats -= logprobs[b, t, target].item()
                num_bytes += int(token_bytes[target])
    assert val["val/token_bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-5)
    # The loss itself still counts every target (it is what training minimises).
    assert val["val/ce"] == pytest.approx(ce_all / 28, rel=1e-5)


# ----------------------------------------------------------------------------- budgets

D, LAYERS, INNER, S, MB, GLOBAL, V, U = 64, 2, 256, 64, 16, 32, 512, 300


def budget_cfg(objective: str, **extra) -> Config:
    """The tiny decoder's shape: 2 layers, d=64, MLP 256, 16 × 64 tokens per micro-batch,
    2 micro-batches per optimizer step."""
    return apply_overrides(
        Config(),
        {
            "objective.name": objective,
            "model.hidden_size": D,
            "model.num_layers": LAYERS,
            "model.num_heads": 2,
            "model.intermediate_size": INNER,
            "data.seq_len": S,
            "optim.micro_batch_size": MB,
            "optim.global_batch_size": GLOBAL,
            **extra,
        },
    )


def hand_step_flops(objective: str) -> float:
    """flops.py's formulas by hand: 3 × (body + head) forward matmul FLOPs per micro-batch,
    times the step's GLOBAL / MB micro-batches."""
    body_per_token = LAYERS * (2 * (4 * D * D + 2 * D * INNER) + 4 * S * D)
    rows = MB * (S - 1)  # K: next-token targets
    head = rows * 2 * D * V if objective == "vanilla" else 2 * rows * U * D
    return 3 * (MB * S * body_per_token + head) * (GLOBAL // MB)


def test_equal_flops_give_steps_in_the_inverse_ratio_of_flops_per_step():
    from hlm_ray.budget import resolve_budget

    vanilla_fps, headless_fps = hand_step_flops("vanilla"), hand_step_flops("headless")
    budget = 1000 * vanilla_fps
    van, van_plan = resolve_budget(budget_cfg("vanilla", **{"budget.flops": budget}), V)
    cwt, cwt_plan = resolve_budget(
        budget_cfg("headless", **{"budget.flops": budget, "budget.unique_columns": U}), V
    )
    assert van_plan.flops_per_step == pytest.approx(vanilla_fps, rel=1e-12)
    assert cwt_plan.flops_per_step == pytest.approx(headless_fps, rel=1e-12)
    assert van.optim.max_steps == van_plan.steps == 1000
    assert cwt.optim.max_steps == cwt_plan.steps == math.floor(1000 * vanilla_fps / headless_fps)
    assert cwt_plan.steps / van_plan.steps == pytest.approx(vanilla_fps / headless_fps, abs=1e-3)
    assert (
        cwt_plan.unique_columns == U and cwt_plan.unique_columns_source == "budget.unique_columns"
    )
    # Without a given or measured U, the bound min(K, V) = V prices the headless step.
    _, bound = resolve_budget(budget_cfg("headless", **{"budget.flops": budget}), V)
    assert bound.unique_columns is None and bound.flops_per_step > headless_fps


def test_a_token_budget_is_floored_to_whole_steps_and_refused_below_one():
    from hlm_ray.budget import resolve_budget

    per_step = GLOBAL * S  # tokens of one optimizer step
    cfg, plan = resolve_budget(budget_cfg("vanilla", **{"budget.tokens": 10 * per_step + 1}), V)
    assert plan.steps == cfg.optim.max_steps == 10 and plan.tokens_per_step == per_step
    cfg, _ = resolve_budget(budget_cfg("vanilla", **{"budget.tokens": 11 * per_step - 1}), V)
    assert cfg.optim.max_steps == 10  # never more tokens than the budget
    with pytest.raises(HLMError, match=r"budget.tokens=2047 is less than one optimizer step"):
        resolve_budget(budget_cfg("vanilla", **{"budget.tokens": per_step - 1}), V)


def test_budget_options_are_validated_by_name():
    with pytest.raises(HLMError, match="give one budget, not budget.tokens and budget.flops"):
        budget_cfg("vanilla", **{"budget.tokens": 100, "budget.flops": 1e12})
    with pytest.raises(HLMError, match=r"budget.seconds=-1.0 is not allowed; must be > 0"):
        budget_cfg("vanilla", **{"budget.seconds": -1})
    with pytest.raises(HLMError, match="budget.unique_columns=9 .* only applies with budget.flops"):
        budget_cfg("headless", **{"budget.tokens": 100, "budget.unique_columns": 9})
    assert budget_cfg("vanilla", **{"budget.flops": "3e13"}).budget.flops == 3e13  # as --set


def test_a_budget_can_set_the_warm_up_as_a_share_of_its_steps():
    from hlm_ray.budget import resolve_budget

    base = {"budget.flops": 1e12, "optim.warmup_steps": 7}
    cfg, plan = resolve_budget(budget_cfg("vanilla", **base, **{"budget.warmup_share": 0.1}), V)
    assert cfg.optim.warmup_steps == round(0.1 * plan.steps) and plan.steps > 20
    cfg, _ = resolve_budget(budget_cfg("vanilla", **base), V)
    assert cfg.optim.warmup_steps == 7  # not set: optim.warmup_steps as it is
    small, plan = resolve_budget(budget_cfg("vanilla", **{"budget.tokens": 2048 * 3,
                                                          "budget.warmup_share": 0.1}), V)  # fmt: skip
    assert plan.steps == 3 and small.optim.warmup_steps == 1  # at least one step
    with pytest.raises(HLMError, match=r"budget.warmup_share=1.5 is not allowed"):
        budget_cfg("vanilla", **{"budget.flops": 1e12, "budget.warmup_share": 1.5})


def tiny_run_cfg(objective: str, out, **extra) -> Config:
    from hlm_ray.paths import data_dir
    from hlm_ray.presets import load_config

    overrides = {
        "data.sources": [str(data_dir() / "corpus" / "en" / "tinyshakespeare.txt")],
        "tokenizer.vocab_size": 512,
        "optim.warmup_steps": 2,
        "run.output_dir": str(out),
        "run.log_every": 2,
        **extra,
    }
    return load_config("tiny-decoder", objective=objective, overrides=overrides)


def test_a_flops_budget_run_spans_its_schedule_and_logs_what_it_became(tmp_path):
    from hlm_ray.budget import flops_per_step
    from hlm_ray.tracking import read_metrics
    from hlm_ray.train.loop import train_worker

    cfg = tiny_run_cfg("headless", tmp_path, **{"budget.flops": 1.4e10, "optim.max_steps": 999})
    summary = train_worker(cfg.to_dict(), progress=False)
    budget = summary["budget"]
    assert budget["budget/unique_columns_source"] == "measured on the first micro-batch"
    steps = budget["budget/steps"]
    assert summary["steps"] == budget["budget/steps_run"] == steps
    assert steps == math.floor(1.4e10 / budget["budget/flops_per_step"]) and 3 < steps < 999
    rows = read_metrics(tmp_path)
    first = next(r for r in rows if "budget/flops_per_step" in r)
    assert first["step"] == 0 and first["budget/steps"] == steps
    # The linear schedule decays over the budget's steps: lr 0 at the last one, not at 999.
    last_lr = [r["train/lr"] for r in rows if "train/lr" in r][-1]
    assert last_lr == pytest.approx(0.0, abs=1e-12)
    # The run's measured U prices the FLOPs it really spent.
    U_run = [r["train/U"] for r in rows if "train/U" in r][-1]
    measured = flops_per_step(cfg, summary["vocab_size"], unique_columns=int(U_run))
    assert budget["budget/flops_per_step_measured"] == pytest.approx(measured)


@pytest.mark.parametrize("objective", ["headless", "vanilla"])  # vanilla: embed_out on resume
def test_a_wall_time_budget_stops_a_run_with_a_checkpoint(objective, tmp_path):
    from hlm_ray.train import checkpoint as ckpt
    from hlm_ray.train.loop import train_worker

    extra = {"budget.seconds": 1.0, "optim.max_steps": 100_000, "run.checkpoint_every": 10_000}
    cfg = tiny_run_cfg(objective, tmp_path, **extra)
    summary = train_worker(cfg.to_dict(), progress=False)
    done = summary["steps"]
    assert 1 <= done < 100_000
    assert summary["budget"]["budget/steps_run"] == done
    assert summary["budget"]["budget/train_seconds"] >= 1.0
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == [done]
    assert (tmp_path / "model" / "config.json").is_file()  # the final model is saved
    # Resumed, the spent budget carries over: no further steps.
    again = train_worker(cfg.to_dict(), resume_from=tmp_path, progress=False)
    assert again["steps"] == done


# ----------------------------------------------------------------------------- clm recipes


def test_clm_recipes_are_the_papers():
    from hlm_ray.finetune.clm import RECIPES

    table_14 = {
        "optim.lr": 1e-5,
        "optim.weight_decay": 0.0,
        "optim.schedule": "constant",
        "optim.warmup_steps": 2000,
        "optim.global_batch_size": 256,
        "optim.max_steps": 10_000,
    }
    assert {k: RECIPES["appendix"][k] for k in table_14} == table_14
    # §4.2: lr 1e-4, constant with 2000 warm-up steps, batch 256, 10k steps; the rest as in
    # pretraining (Table 7: AdamW (0.9, 0.95), weight decay 0.1).
    text = RECIPES["text"]
    assert (text["optim.lr"], text["optim.schedule"], text["optim.warmup_steps"]) == (
        1e-4,
        "constant",
        2000,
    )
    assert (text["optim.betas"], text["optim.weight_decay"]) == ((0.9, 0.95), 0.1)
    assert RECIPES["code"]["optim.schedule"] == "cosine" and RECIPES["code"]["optim.lr"] == 1e-4


def test_clm_config_keeps_the_pretraining_optimizer_except_what_table_14_sets(tmp_path):
    from hlm_ray.finetune.clm import clm_config

    base = apply_overrides(
        Config(),
        {"optim.betas": [0.8, 0.9], "optim.weight_decay": 0.05, "optim.grad_clip": 0.5},
    )
    model = build_model(base.model, vocab_size=64, objective="headless", special_ids={})
    model.save_pretrained(tmp_path / "run" / "model")
    base.save(tmp_path / "run" / "config.yaml")
    for recipe, decay in (("text", 0.05), ("code", 0.05), ("appendix", 0.0)):
        cfg, _ = clm_config(tmp_path / "run", recipe=recipe, output_dir=tmp_path / recipe)
        assert cfg.optim.betas == (0.8, 0.9) and cfg.optim.grad_clip == 0.5, recipe
        assert cfg.optim.weight_decay == decay, recipe
    # Without its run config: Table 7's values.
    (tmp_path / "run" / "config.yaml").unlink()
    cfg, _ = clm_config(tmp_path / "run", recipe="text", output_dir=tmp_path / "bare")
    assert (cfg.optim.betas, cfg.optim.weight_decay) == ((0.9, 0.95), 0.1)


# ----------------------------------------------------------------------------- encoder blocks


@pytest.fixture(scope="module")
def encoder_corpus(tmp_path_factory):
    from hlm_ray.train.inputs import build_corpus, build_tokenizer, special_ids

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        cfg = tiny_run_cfg("headless", tmp_path_factory.mktemp("enc"))
        cfg = apply_overrides(
            cfg,
            {
                "model.arch": "bert",
                "data.seq_len": 16,
                "tokenizer.vocab_size": 512,
                "optim.weight_decay": 0.0,
            },
        )
        tokenizer = build_tokenizer(cfg)
        return cfg, tokenizer, build_corpus(cfg, tokenizer), special_ids(tokenizer)


def test_encoder_blocks_are_cls_text_sep_and_cover_the_stream(encoder_corpus):
    cfg, tokenizer, corpus, ids = encoder_corpus
    assert (ids["cls_token"], ids["sep_token"]) == (
        tokenizer.convert_tokens_to_ids("<|cls|>"),
        tokenizer.convert_tokens_to_ids("<|sep|>"),
    )
    blocks_BL = corpus.train[torch.arange(3)]
    assert blocks_BL.shape == (3, 16)
    assert (blocks_BL[:, 0] == ids["cls_token"]).all() and (
        blocks_BL[:, -1] == ids["sep_token"]
    ).all()
    # The text between is the stream, 14 tokens per block, in order, nothing skipped.
    stream = corpus.train.blocks.read_all()[: 3 * 14]
    assert blocks_BL[:, 1:-1].reshape(-1).tolist() == stream.tolist()
    assert corpus.val[0].shape == (16,) and corpus.val[0][0] == ids["cls_token"]


@pytest.mark.parametrize("objective", ["headless", "vanilla"])
def test_cls_is_never_a_target_but_its_embedding_row_is_trained(encoder_corpus, objective):
    from hlm_ray.models import input_embedding_weight
    from hlm_ray.train.inputs import Masking, stream_seed

    cfg, tokenizer, corpus, ids = encoder_corpus
    cfg = apply_overrides(cfg, {"objective.name": objective})
    masking = Masking(cfg, tokenizer, ids)
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=len(tokenizer), objective=objective, special_ids=ids)
    module = LMObjective(model, cfg.objective)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    weight_VD = input_embedding_weight(model)
    cls_before = weight_VD[ids["cls_token"]].detach().clone()
    for step in range(3):
        inputs_BL, labels_BL = masking(
            corpus.train[torch.arange(16) + 16 * step], stream_seed(0, step, 0, 0)
        )
        targets = labels_BL[labels_BL != -100]
        assert not torch.isin(targets, torch.tensor([ids["cls_token"], ids["sep_token"]])).any()
        assert (inputs_BL[:, 0] == ids["cls_token"]).all()  # never masked or replaced
        optimizer.zero_grad()
        module(inputs_BL, labels_BL)["loss"].loss.backward()
        assert weight_VD.grad[ids["cls_token"]].abs().sum() > 0  # through attention
        optimizer.step()
    assert not torch.allclose(weight_VD[ids["cls_token"]], cls_before)  # weight decay is 0
    # The old layout (no [CLS] in the input): the headless loss gives its row no gradient.
    if objective == "headless":
        optimizer.zero_grad()
        inputs_BL, labels_BL = masking(corpus.train[torch.arange(16)][:, 1:-1], 7)
        module(inputs_BL, labels_BL)["loss"].loss.backward()
        assert weight_VD.grad[ids["cls_token"]].abs().sum() == 0


def test_a_retried_sweep_trial_reuses_a_finished_budgeted_run(tmp_path):
    """A trial retried after a downstream failure must not retrain a run whose budget (not
    optim.max_steps) decided its steps."""
    import json

    from hlm_ray.tune.trial import _finished_summary

    (tmp_path / "model").mkdir()
    summary = {"steps": 37, "tokens_per_s": 100.0}
    write = lambda s: (tmp_path / "summary.json").write_text(json.dumps(s))  # noqa: E731
    write(summary)
    assert _finished_summary(tmp_path, 150) is None  # an unbudgeted run stopped at 37 of 150
    write({**summary, "budget": {"budget/kind": "flops", "budget/steps": 37}})
    assert _finished_summary(tmp_path, 150)["steps"] == 37
    write({**summary, "budget": {"budget/kind": "flops", "budget/steps": 40}})
    assert _finished_summary(tmp_path, 150) is None  # stopped short of its budget
    write({**summary, "budget": {"budget/kind": "seconds", "budget/steps": 150}})
    assert _finished_summary(tmp_path, 150)["steps"] == 37  # stopped at its deadline


def test_a_saved_encoder_tokenizer_frames_text_as_pretraining_did(tmp_path):
    """The exported encoder's tokenizer adds [CLS] ... [SEP] (pairs too), as its pretraining
    blocks and the classifiers' inputs are built; a decoder's adds nothing."""
    from test_train import tiny_cfg
    from transformers import AutoTokenizer

    from hlm_ray.classify.template import special_ids
    from hlm_ray.train.loop import train_worker

    cfg = tiny_cfg("tiny-encoder", "headless", tmp_path / "enc", **{"optim.max_steps": 2})
    train_worker(cfg.to_dict(), progress=False)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "enc" / "model"))
    cls, sep = special_ids(tok)
    a = tok("the cat sat", add_special_tokens=False)["input_ids"]
    b = tok("on the mat", add_special_tokens=False)["input_ids"]
    assert tok("the cat sat")["input_ids"] == [cls, *a, sep]
    assert tok("the cat sat", "on the mat")["input_ids"] == [cls, *a, sep, *b, sep]
    assert (tmp_path / "enc" / "model" / "README.md").is_file()

    cfg = tiny_cfg("tiny-decoder", "headless", tmp_path / "dec", **{"optim.max_steps": 2})
    train_worker(cfg.to_dict(), progress=False)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "dec" / "model"))
    assert (
        tok("the cat sat")["input_ids"] == tok("the cat sat", add_special_tokens=False)["input_ids"]
    )
