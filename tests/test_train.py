"""The per-worker training loop, end to end on real text, in one process (no Ray)."""

import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import SHAKESPEARE, tiny_run_cfg
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from hlm_ray.cli import main
from hlm_ray.data import BlockSampler
from hlm_ray.errors import HLMError
from hlm_ray.flops import config_step_flops
from hlm_ray.tokenizer import token_byte_lengths
from hlm_ray.tracking import read_metrics
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.inputs import Masking, build_corpus, build_tokenizer, special_ids
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.loop import WorkerEnv, evaluate, train_worker
from hlm_ray.unigram import COUNTS_FILE, load_counts


def tiny_cfg(preset, objective, out, **extra):
    """40 steps (5 of warm-up), logged every 5, validated at the end, checkpointed every 20."""
    extra = {"optim.warmup_steps": 5, **extra}
    return tiny_run_cfg(out, preset, objective, steps=40, every=(5, 40, 20), **extra)


def reload_plain(model_dir, cfg):
    """The saved model through plain transformers only."""
    if cfg.model.family == "decoder":
        return AutoModelForCausalLM.from_pretrained(model_dir)
    if cfg.objective.name == "headless":
        return AutoModel.from_pretrained(model_dir)
    return AutoModelForMaskedLM.from_pretrained(model_dir)


@pytest.mark.parametrize(
    ("preset", "objective"),
    [
        ("tiny-decoder", "headless"),
        ("tiny-decoder", "vanilla"),
        ("tiny-decoder", "mixed"),
        ("tiny-encoder", "headless"),
        ("tiny-encoder", "vanilla"),
    ],
)
def test_tiny_run_lowers_its_loss_and_saves_a_plain_transformers_model(preset, objective, tmp_path):
    # Masked LM sees ~15% of the tokens per step: it gets more steps to show progress.
    steps = 40 if preset == "tiny-decoder" else 80
    cfg = tiny_cfg(
        preset, objective, tmp_path / "run", **{"optim.max_steps": steps, "run.eval_every": steps}
    )
    summary = train_worker(cfg.to_dict(), progress=False)

    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(losses) == steps // 5
    assert sum(losses[-2:]) / 2 < losses[0] - 0.15, losses
    assert summary["steps"] == steps and summary["tokens"] == steps * 32 * 64
    # Every step's seconds, for the sweeps' speed intervals; they add up to the training time.
    timed = summary["step_seconds"]
    assert timed["first_step"] == 1 and len(timed["values"]) == steps
    assert sum(timed["values"]) == pytest.approx(summary["seconds"]["train"], rel=1e-3)
    # Measured U: distinct target ids of a micro-batch, at most min(K, V), in the FLOP model.
    m = summary["metrics"]
    assert 1 < m["train/U"] <= min(m["train/K"], summary["vocab_size"])
    measured = config_step_flops(cfg, summary["vocab_size"], unique_columns=int(m["train/U"]))
    assert m["train/flops_per_token"] == pytest.approx(measured.per_token)
    # The newest run.keep_checkpoints are kept, and a copy of the best (lowest val loss).
    kept = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert kept == [steps - 20, steps]
    assert ckpt.checkpoint_step(tmp_path / "run" / "best_checkpoint") == steps

    # The saved model, loaded by plain transformers, scores the validation slice exactly as the
    # trained model did at the last step: it is the trained model.
    model = reload_plain(summary["model_dir"], cfg).eval()
    assert model.config.vocab_size == summary["vocab_size"]
    tokenizer = build_tokenizer(cfg)
    corpus = build_corpus(cfg, tokenizer)
    masking = Masking(cfg, tokenizer, special_ids(tokenizer)) if preset == "tiny-encoder" else None
    val = evaluate(
        LMObjective(model, cfg.objective),
        corpus.val,
        cfg,
        WorkerEnv(),
        masking,
        torch.as_tensor(token_byte_lengths(tokenizer)),
        None,
    )
    for key, value in val.items():
        assert value == pytest.approx(summary["metrics"][key], rel=1e-4), key


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder"])
def test_resume_reproduces_the_uninterrupted_runs_next_losses(preset, tmp_path):
    extra = {
        "run.log_every": 1,
        "run.checkpoint_every": 10,
        "optim.max_steps": 16,
        "model.dropout": 0.1,
    }  # dropout: the RNG state must be restored too
    full = tiny_cfg(preset, "headless", tmp_path / "full", **extra)
    train_worker(full.to_dict(), progress=False)

    broken = tiny_cfg(preset, "headless", tmp_path / "broken", **extra, **{"run.fail_at_step": 13})
    with pytest.raises(RuntimeError, match="injected failure at step 13"):
        train_worker(broken.to_dict(), progress=False)
    last = ckpt.list_checkpoints(tmp_path / "broken")[-1]
    assert ckpt.checkpoint_step(last) == 10
    train_worker(broken.to_dict(), resume_from=last, progress=False)

    def losses(run):
        return {
            r["step"]: r["train/loss"] for r in read_metrics(tmp_path / run) if "train/loss" in r
        }

    expected, resumed = losses("full"), losses("broken")
    assert sorted(resumed) == list(range(1, 17))  # steps 11-13 were redone, not duplicated
    for step in range(11, 17):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    # The target tokens (next tokens; masked originals) counted once across the resume.
    counts = [load_counts(tmp_path / run / "model" / COUNTS_FILE)[0] for run in ("full", "broken")]
    assert (counts[0] == counts[1]).all() and counts[0].sum() > 0


def test_a_worker_restarted_elsewhere_from_the_last_checkpoint_finishes_with_the_model(tmp_path):
    """The cluster box's partition: rank 0's node lost after it reported the final checkpoint,
    while the run was finishing. The worker restarted on another node resumes from that
    checkpoint with no step left, in a run folder without the model (the lost node had it):
    it finishes with the checkpoint's model (before: FileNotFoundError for model/config.json,
    on every retry)."""
    cfg = tiny_cfg("tiny-decoder", "headless", tmp_path / "lost-node", **{"optim.max_steps": 20})
    train_worker(cfg.to_dict(), progress=False)
    final = ckpt.list_checkpoints(tmp_path / "lost-node")[-1]
    assert ckpt.checkpoint_step(final) == 20
    elsewhere = tiny_cfg("tiny-decoder", "headless", tmp_path / "other-node",
                         **{"optim.max_steps": 20})  # fmt: skip
    summary = train_worker(elsewhere.to_dict(), resume_from=final, progress=False)
    assert summary["steps"] == 20
    model = tmp_path / "other-node" / "model"
    assert (model / "model.safetensors").read_bytes() == (
        final / "model" / "model.safetensors"
    ).read_bytes()
    assert "| training steps | 20 |" in (model / "README.md").read_text()

    # Nothing left to train blanked the summary: "tokens_per_s": NaN (not JSON) and no metrics.
    def strict(path):
        return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {path}"))

    earlier = strict(tmp_path / "lost-node" / "summary.json")
    written = strict(tmp_path / "other-node" / "summary.json")
    assert written["metrics"] == earlier["metrics"] and "val/loss" in written["metrics"]
    assert written["tokens_per_s"] == earlier["metrics"]["train/tokens_per_s"]  # the last window's
    again = train_worker(cfg.to_dict(), resume_from=final, progress=False)  # a finished run resumed
    assert again["tokens_per_s"] == earlier["tokens_per_s"]
    assert strict(tmp_path / "lost-node" / "summary.json")["metrics"] == earlier["metrics"]


def test_interrupted_checkpoint_save_leaves_the_last_one_intact(tmp_path, monkeypatch):
    cfg = tiny_cfg("tiny-decoder", "headless", tmp_path / "run", **{"optim.max_steps": 20})
    train_worker(cfg.to_dict(), progress=False)
    root = tmp_path / "run"
    card = (root / "model" / "README.md").read_text()  # every saved model folder has its card
    assert "raw headless decoder" in card.lower() and "hlm finetune --task clm" in card
    assert "| training steps | 20 |" in card
    before = [p.name for p in ckpt.list_checkpoints(root)]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing a checkpoint

    monkeypatch.setattr(torch, "save", interrupted)
    model = reload_plain(tmp_path / "run" / "model", cfg)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_checkpoint(
            root / "checkpoint_00000030",
            model=model,
            tokenizer=build_tokenizer(cfg),
            config_yaml="",
            train_state={},
            meta={"step": 30},
        )
    assert [p.name for p in ckpt.list_checkpoints(root)] == before
    assert ckpt.resolve_resume(tmp_path / "run").name == before[-1]
    assert not list(root.glob(".tmp-*"))  # the half-written folder went with the interrupt

    # A full disk: torch said `basic_ios::clear: iostream error` and `unexpected pos ...`, with
    # no word of the disk. A 128 kB tmpfs (root mounts it; the suite runs as root) fills up.
    monkeypatch.undo()
    small = tmp_path / "small-disk"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(small)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with pytest.raises(HLMError) as err:
            ckpt.write_checkpoint(small / "checkpoint_00000030", model=model,
                                  tokenizer=build_tokenizer(cfg), config_yaml="",
                                  train_state={}, meta={"step": 30})  # fmt: skip
        message = str(err.value)
        assert message.startswith(f"no space left on device writing checkpoint_00000030 in {small}")
        assert "free space there, then resume" in message and "\n" not in message
        assert os.listdir(small) == []  # nothing half written stays
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_resume_removes_what_a_cut_off_save_left_half_written(tmp_path):
    """A save SIGKILLed mid-write (or cut by a full disk before this fix) left its
    `.tmp-checkpoint_*` folder in the run folder forever."""
    good = tmp_path / "checkpoint_00000010"
    good.mkdir()
    (good / "train_state.pt").write_bytes(b"s")
    ckpt.write_manifest(good, {"step": 10})
    (tmp_path / ".tmp-checkpoint_00000020-4242" / "model").mkdir(parents=True)
    (tmp_path / ".tmp-model").mkdir()
    notes = ckpt.prepare_resume(tmp_path, good)
    assert notes == ["removed what a cut-off save left half written: .tmp-checkpoint_00000020-4242, "
                     ".tmp-model"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000010"]


def test_a_half_copied_marker_is_not_listed_but_still_refuses_a_fresh_run(tmp_path):
    """Ray copies a reported checkpoint into the run folder file by file: a marker seen while
    it is copied (or left so by a crash) is empty. Listing skips it, `verify` calls the folder
    damaged, and a fresh run is still refused the folder."""
    root = tmp_path / "run"
    for step in (8, 16):
        folder = root / f"{ckpt.PREFIX}{step:08d}"
        folder.mkdir(parents=True)
        (folder / "train_state.pt").write_bytes(b"x")
        ckpt.write_manifest(folder, {"step": step})
    (root / f"{ckpt.PREFIX}00000016" / ckpt.MARKER).write_text("")
    assert [p.name for p in ckpt.list_checkpoints(root)] == [f"{ckpt.PREFIX}00000008"]
    assert ckpt.verify(root / f"{ckpt.PREFIX}00000016") == f"unreadable {ckpt.MARKER}"
    (root / f"{ckpt.PREFIX}00000008" / ckpt.MARKER).unlink()
    assert ckpt.list_checkpoints(root) == []
    with pytest.raises(HLMError, match="already holds checkpoints"):
        ckpt.refuse_existing(root)


def test_each_worker_reads_its_own_shard():
    sampler = BlockSampler(num_blocks=100, global_batch=16, seed=0)
    shards = [torch.cat(sampler.shard(3, rank, 2, micro_batch=4)) for rank in range(2)]
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())
    assert sorted(torch.cat(shards).tolist()) == sorted(sampler.indices(3).tolist())


def test_one_step_has_the_same_gradient_with_one_or_four_micro_batches(tmp_path):
    """Accumulation divides each micro-batch's loss by their number before `backward`, so a
    step's gradient is the whole batch's whatever `micro_batch_size` (and the world size) is:
    its norm (`train/grad_norm`, what `optim.grad_clip` clips) and the loss it logs (the
    vanilla decoder's loss is a mean over equal micro-batches, so both are equal). K stays
    one micro-batch's row count (63 next-token rows a sequence), the mean over micro-batches."""
    from hlm_ray.train.setup import setup_run
    from hlm_ray.train.step import train_step

    seen = {}
    for micro in (32, 8):
        out = tmp_path / f"micro{micro}"
        cfg = tiny_run_cfg(
            out, "tiny-decoder", "vanilla", steps=1, every=(1, 1, 1), batch=(32, micro)
        )
        run = setup_run(cfg, None, None, None, None)
        assert run.accum == 32 // micro
        train_step(run, 0)
        seen[micro] = [float(run.grad_norm), float(run.loss_sum)]
        assert float(run.rows_sum) == 63 * micro
        run.tracker.finish()
    assert seen[8] == pytest.approx(seen[32], rel=1e-5)
    assert seen[32][0] > 0


def test_cli_train_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(
        [
            "train",
            "--local",
            "--preset",
            "tiny-decoder",
            "--objective",
            "vanilla",
            "--output",
            str(out),
            "--set",
            f"data.sources=[{SHAKESPEARE}]",
            "--set",
            "optim.max_steps=10",
            "--set",
            "tokenizer.vocab_size=512",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| vanilla | gpt_neox | 10 |" in printed and str(out / "model") in printed
    assert json.loads((out / "params.json").read_text())["objective.name"] == "vanilla"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--objective", "magic"], "unknown objective 'magic'"),
        (["--set", "tokenizer.vocab_size=100"], "use at least"),
        (["--set", "data.sources=[/nonexistent/corpus.txt]"], "/nonexistent/corpus.txt"),
        (["--set", "data.seq_len=512"], "must not exceed model.max_positions=128"),
        (["--set", "optim.global_batch_size=24"], "not divisible"),
        (["--set", "tokenizer.kind=file", "--set", "tokenizer.path=BAD"], "BAD"),
        (["--resume", "RESUME"], "not a checkpoint"),
    ],
)
def test_bad_input_stops_before_training_with_one_line(args, message, tmp_path, capsys):
    args = [
        a.replace("BAD", str(tmp_path / "bad.json")).replace("RESUME", str(tmp_path)) for a in args
    ]
    (tmp_path / "bad.json").write_text("{not json")
    code = main(["train", "--local", "--output", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err
    assert message.replace("BAD", str(tmp_path / "bad.json")) in err, err
    assert not ckpt.list_checkpoints(tmp_path / "out")


def test_empty_corpus_and_existing_output_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert (
        main(
            [
                "train",
                "--local",
                "--output",
                str(tmp_path / "o"),
                "--set",
                f"data.sources=[{empty}]",
            ]
        )
        == 2
    )
    assert "empty" in capsys.readouterr().err.lower()
    done = tmp_path / "o" / "checkpoint_00000010"
    done.mkdir(parents=True)
    (done / ckpt.MARKER).write_text('{"step": 10}')
    assert main(["train", "--local", "--output", str(tmp_path / "o")]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_measured_u_counts_distinct_ids_among_all_workers_negatives():
    from hlm_ray.train.log_window import measured_unique_columns

    ids_BL = torch.tensor([[5, 1, 1, 2], [5, 2, 2, 2]])  # targets 1 1 2 2 2 2: U = 2
    assert measured_unique_columns(ids_BL, None, None) == 2
    labels_BL = torch.tensor([[-100, 7, -100, 7], [3, -100, -100, -100]])
    assert measured_unique_columns(ids_BL, labels_BL, None) == 2
    gathered = torch.tensor([1, 1, 2, 2, 2, 2, 9, 1, 4, 4, 2, 2])  # two workers' targets
    assert measured_unique_columns(ids_BL, None, gathered) == 4


def test_the_summary_table_names_its_columns_and_groups_large_counts():
    """`hlm train`'s printed table: one row a run, metrics only where some run has them."""
    from hlm_ray.train.summary import format_summary

    run = {"objective": "headless", "arch": "gpt_neox", "steps": 10, "tokens": 123456}
    run |= {"tokens_per_s": 12345.6, "vocab_size": 512, "parameters": 1234567}
    run |= {"metrics": {"train/loss": 1.5}, "model_dir": "runs/x/model"}
    assert format_summary([run]).splitlines() == [
        "| objective | arch | steps | tokens | tokens/s | vocab | params | train loss |",
        "|---|---|---|---|---|---|---|---|",
        "| headless | gpt_neox | 10 | 123,456 | 12,346 | 512 | 1,234,567 | 1.5000 |",
        "headless model: runs/x/model",
    ]


def test_check_finite_loss_names_the_step_and_window():
    from hlm_ray.train.log_window import check_finite_loss

    check_finite_loss(2.5, done=10, steps=5)  # finite: nothing
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(HLMError, match=r"diverged: the loss is .* at step 10 .*steps 6\.\.10"):
            check_finite_loss(bad, done=10, steps=5)


LR_1E30 = {"optim.lr": 1e30}


def _nan_gradients_at(monkeypatch, steps: set[int]) -> None:
    """Make the gradient NaN at these (1-based) optimizer steps, as an overflow would: each
    parameter's gradient is filled with NaN before it is clipped."""
    from hlm_ray.train import step as step_mod

    real, calls = step_mod.clip_grad_norm, iter(range(1, 10_000))

    def clip(parameters, max_norm):
        parameters = list(parameters)
        if next(calls) in steps:
            for p in parameters:
                if p.grad is not None:
                    p.grad.fill_(math.nan)
        return real(parameters, max_norm)

    monkeypatch.setattr(step_mod, "clip_grad_norm", clip)


def test_skip_mode_drops_a_non_finite_step_and_trains_on(tmp_path, monkeypatch, capsys):
    """optim.on_nonfinite=skip: a NaN gradient at step 3 leaves the weights and the optimizer's
    moments as they were (else AdamW's moments would be NaN and so every later weight); the run
    ends with finite weights, says which step it skipped, and logs the count."""
    _nan_gradients_at(monkeypatch, {3})
    out = tmp_path / "skip"
    cfg = tiny_run_cfg(out, steps=8, every=(4, 8, 8), **{"optim.on_nonfinite": "skip"})
    train_worker(cfg.to_dict(), progress=False)
    err = capsys.readouterr().err
    assert "step 3: the gradient is nan; its update is skipped" in err
    weights = AutoModel.from_pretrained(out / "model").state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values())
    rows = [r for r in read_metrics(out) if "train/skipped_steps" in r]
    assert [(r["step"], r["train/skipped_steps"]) for r in rows] == [(4, 1.0), (8, 1.0)]
    assert all(math.isfinite(r["train/loss"]) for r in rows)


def test_skip_mode_logs_a_window_whose_every_step_was_skipped(tmp_path, monkeypatch):
    """log_every=1 and a NaN gradient at step 2: that window's one step was skipped, so it has
    no loss; it is logged without one (the count says why) and the run trains on to its end."""
    _nan_gradients_at(monkeypatch, {2})
    out = tmp_path / "skip1"
    cfg = tiny_run_cfg(out, steps=3, every=(1, 3, 3), **{"optim.on_nonfinite": "skip"})
    summary = train_worker(cfg.to_dict(), progress=False)
    rows = {r["step"]: r for r in read_metrics(out) if "train/skipped_steps" in r}
    assert [(s, rows[s]["train/skipped_steps"]) for s in sorted(rows)] == [(1, 0), (2, 1), (3, 1)]
    assert "train/loss" not in rows[2]
    assert all(math.isfinite(rows[s]["train/loss"]) for s in (1, 3))
    assert summary["steps"] == 3 and (out / "model").is_dir()


def test_skip_mode_stops_after_too_many_skipped_steps_in_a_row(tmp_path, monkeypatch):
    _nan_gradients_at(monkeypatch, set(range(3, 100)))
    out = tmp_path / "skips"
    overrides = {"optim.on_nonfinite": "skip", "optim.max_skipped_steps": 2}
    cfg = tiny_run_cfg(out, steps=12, every=(4, 12, 2), **overrides)
    with pytest.raises(HLMError, match=r"3 steps in a row \(steps 3\.\.5\), more than .*=2"):
        train_worker(cfg.to_dict(), progress=False)
    assert not (out / "model").exists()
    assert max(ckpt.checkpoint_step(f) for f in ckpt.list_checkpoints(out)) == 4


@pytest.mark.parametrize("every", [(4, 12, 2), (2, 12, 4)], ids=["ckpt-between-logs", "usual"])
def test_a_diverged_run_stops_at_the_step_and_saves_no_nan_weights(tmp_path, every):
    """optim.lr=1e30: the weights are NaN within a few steps. The run stops at the first log or
    checkpoint step that sees the loss, saves no model, and every checkpoint it kept is finite,
    whatever the layout: checkpoints every 2 steps and logs every 4 (the checkpoint steps
    between logs check), or the usual one, checkpoints at log steps (the log step checks)."""
    out = tmp_path / "nan"
    cfg = tiny_run_cfg(out, "tiny-decoder", "headless", steps=12, every=every, **LR_1E30)
    with pytest.raises(HLMError, match=r"training diverged: the loss is \w+ at step \d+") as err:
        train_worker(cfg.to_dict(), progress=False)
    assert "\n" not in str(err.value)
    assert not (out / "model").exists() and not (out / "summary.json").exists()
    stopped = int(str(err.value).split(" at step ")[1].split()[0])
    assert stopped < 12
    for folder in ckpt.list_checkpoints(out):
        assert ckpt.checkpoint_step(folder) < stopped
        weights = load_file(folder / "model" / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), folder.name


def test_a_restart_before_the_first_checkpoint_sends_each_step_to_mlflow_once(
    tmp_path, mlflow_store
):
    """A worker group restarted before its first checkpoint (a node lost) starts again from
    step 0 in the same MLflow run, perhaps with rank 0 on another node (no metrics.jsonl): the
    steps the dead attempt sent are not sent again (the cluster box saw 69 points for 60 steps,
    steps 1-9 twice). Rank 0's tracker as `setup_run` opens it, on a real store."""
    from mlflow import MlflowClient

    from hlm_ray.tracking import MlflowTracker
    from hlm_ray.train.run_tracking import open_tracker

    run = MlflowTracker("test-restart-from-0", "restarted", tracking_uri=mlflow_store)
    tracking = {"experiment": "test-restart-from-0", "uri": mlflow_store, "run_id": run.run_id}
    dead = open_tracker(tmp_path / "node-a", tracking, resuming=False)  # the first attempt
    for step in (1, 2, 3):
        dead.log_metrics({"train/loss": 1.0 / step}, step=step)
    restarted = open_tracker(tmp_path / "node-b", tracking, resuming=False)
    for step in (1, 2, 3, 4):
        restarted.log_metrics({"train/loss": 1.0 / step}, step=step)
    history = MlflowClient(mlflow_store).get_metric_history(run.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert read_metrics(tmp_path / "node-b") == [  # its own record is whole
        {"step": step, "train/loss": 1.0 / step} for step in (1, 2, 3, 4)
    ]
