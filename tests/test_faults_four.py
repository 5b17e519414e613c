"""Faults from outside, round four (issue 62), as plain functions: a resume that does what it
records, damaged checkpoints never deleted, and the leftovers a resume may remove."""

import os

import pytest

from hlm_ray.cli import main
from hlm_ray.errors import HLMError
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.resume import RESUMABLE, resumed_config
from tests.test_faults import fake_checkpoint


def test_a_resume_refuses_a_setting_it_would_record_but_not_honour(tmp_path, capsys):
    folder = fake_checkpoint(tmp_path / "run", 60)
    before = (folder / "config.yaml").read_text()
    with pytest.raises(HLMError) as err:
        resumed_config(folder, overrides=["optim.lr=0.5", "optim.max_steps=80"])
    said = str(err.value)
    assert "\n" not in said and said.startswith("optim.lr=0.5: a resume continues the run")
    assert "(optim.lr=0.003)" in said and f"can change only {', '.join(RESUMABLE)}" in said
    assert "new run with --output" in said
    with pytest.raises(HLMError, match=r"^optim.betas=\[0.8, 0.9\], optim.weight_decay=0.5: "):
        resumed_config(folder, overrides=["optim.weight_decay=0.5", "optim.betas=[0.8,0.9]"])

    # What a resume honours still passes, and is what the config says.
    cfg = resumed_config(folder, overrides=["optim.max_steps=80", "run.log_every=5"])
    assert cfg.optim.max_steps == 80 and cfg.run.log_every == 5 and cfg.optim.lr == 0.003
    with pytest.raises(HLMError, match="optim.max_steps=40 is below step 60 of checkpoint_"):
        resumed_config(folder, overrides=["optim.max_steps=40"])

    # From the command line: one line, exit 2, and nothing in the run folder rewritten.
    code = main(["train", "--local", "--resume", str(tmp_path / "run"), "--set", "optim.lr=0.5"])
    out = capsys.readouterr().err.strip()
    assert code == 2 and out.startswith("error: optim.lr=0.5: a resume") and "\n" not in out
    assert (folder / "config.yaml").read_text() == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [folder.name]


def test_a_budgeted_runs_steps_are_not_changed_on_resume(tmp_path):
    from hlm_ray.presets import load_config

    folder = fake_checkpoint(tmp_path / "run", 10)
    cfg = load_config("tiny-decoder", overrides={"budget.tokens": 100_000})
    (folder / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(HLMError, match="come from its budget"):
        resumed_config(folder, overrides=["optim.max_steps=500"])


def test_a_damaged_newest_checkpoint_is_set_aside_not_deleted_with_a_relative_resume(
    tmp_path, monkeypatch, capsys
):
    """`hlm train --resume runs/x` names the run relative to the current folder, the run
    folder is absolute: the newest valid checkpoint was taken for one the user named, and the
    damaged one after it deleted as superseded, with no reason."""
    from hlm_ray.train.launch import prepare_resume

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "x"
    fake_checkpoint(run, 50)
    bad = fake_checkpoint(run, 60)
    (bad / "model" / "model.safetensors").write_bytes(b"w" * 100)
    chosen = ckpt.resolve_resume(os.path.relpath(run))  # what cmd_train passes
    assert not chosen.is_absolute()

    assert prepare_resume(run, chosen).name == "checkpoint_00000050"
    err = capsys.readouterr().err
    assert "removed" not in err
    assert "set aside damaged checkpoint(s): checkpoint_00000060 (model/model.safetensors " in err
    assert "has 100 bytes, the manifest says 1000); resuming from checkpoint_00000050" in err
    assert (run / "damaged-checkpoint_00000060" / "model" / "model.safetensors").is_file()


def test_a_named_older_checkpoint_sets_damaged_newer_ones_aside_and_says_why(tmp_path):
    ten, twenty = fake_checkpoint(tmp_path, 10), fake_checkpoint(tmp_path, 20)
    thirty = fake_checkpoint(tmp_path, 30)
    (thirty / "train_state.pt").write_bytes(b"s")
    notes = ckpt.prepare_resume(tmp_path, ten, explicit=True)
    assert notes[0] == (
        "removed checkpoint(s) after step 10: checkpoint_00000020 (continuing from "
        "checkpoint_00000010, as named)"
    )
    assert "checkpoint_00000030 (train_state.pt has 1 bytes" in notes[1]
    assert not twenty.exists() and (tmp_path / "damaged-checkpoint_00000030").is_dir()


def test_a_resume_removes_only_the_temporary_folders_hlm_writes(tmp_path):
    own = [".tmp-checkpoint_00000020-4242", ".tmp-model", ".tmp-best_checkpoint"]
    other = [".tmp-mine", ".tmp-checkpoint_00000020", ".tmp-model-backup", ".tmp-42-model"]
    for name in own + other:
        (tmp_path / name).mkdir()
    assert ckpt.remove_leftovers(tmp_path) == sorted(own)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(other)
