"""Faults from outside, round four (issue 62), as plain functions: a resume that does what it
records, damaged checkpoints never deleted, and the leftovers a resume may remove."""

import os
from pathlib import Path

import pytest
from test_faults import fake_checkpoint

from hlm_ray.cli import main
from hlm_ray.errors import HLMError
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.resume import resumed_config


def test_a_resume_refuses_a_setting_it_would_record_but_not_honour(tmp_path, capsys):
    from hlm_ray.train.resume import RESUMABLE

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


# ----------------------------------------------------------------------------- model folders


@pytest.fixture(scope="module")
def headless_dir(tiny_decoder_dir, tmp_path_factory):
    """The tiny decoder as a headless one that was never fine-tuned (it reads out through its
    prior: readout.json and token_counts.npz)."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("headless") / "model"
    shutil.copytree(tiny_decoder_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hlm_objective": "headless"}))
    return folder


def _damage(folder, how):
    """A copy of model folder `folder` damaged as `how` says."""
    import json
    import shutil

    import numpy as np

    from hlm_ray.readout import READOUT_FILE
    from hlm_ray.unigram import COUNTS_FILE, load_counts

    copy = folder.parent.parent / f"damaged-{how}" / "model"
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(folder, copy)
    record = json.loads((copy / READOUT_FILE).read_text())
    counts, meta = load_counts(copy / COUNTS_FILE)
    edits = {
        "scale-nan": lambda: {
            **record,
            "prior": {**record.get("prior", {}), "scale": float("nan")},
        },
        "alpha-negative": lambda: {**record, "alpha": -0.5},
        "temperature-0": lambda: {**record, "temperature": 0},
        "temperature-abc": lambda: {**record, "temperature": "abc"},
        "a-list": lambda: [record],
        "readout-bogus": lambda: {**record, "readout": "bogus"},
    }
    if how in edits:
        (copy / READOUT_FILE).write_text(json.dumps(edits[how]()))
    elif how == "counts-truncated":
        path = copy / COUNTS_FILE
        path.write_bytes(path.read_bytes()[:50])
    elif how == "counts-empty":
        (copy / COUNTS_FILE).write_bytes(b"")
    elif how == "counts-zero":  # all zero, the header's total not
        header = json.dumps({**meta, "tokens": int(counts.sum())})
        np.savez_compressed(copy / COUNTS_FILE, counts=0 * counts, meta=np.array(header))
    elif how == "counts-short":  # a consistent file of another vocabulary
        short = counts[:-3]
        header = json.dumps({**meta, "vocab_size": len(short), "tokens": int(short.sum())})
        np.savez_compressed(copy / COUNTS_FILE, counts=short, meta=np.array(header))
    return copy


DAMAGE = {
    "scale-nan": "prior.scale nan is not a positive finite number",
    "alpha-negative": "alpha -0.5 is not a positive finite number",
    "temperature-0": "temperature 0 is not a positive finite number",
    "temperature-abc": "temperature 'abc' is not a positive finite number",
    "a-list": "it holds a JSON list, not an object",
    "readout-bogus": "readout 'bogus' is none of head, tied, prior",
    "counts-truncated": "is not a token-counts file (BadZipFile",
    "counts-empty": "is not a token-counts file (",
    "counts-zero": "its counts do not match its own header",
    "counts-short": "counts for a vocabulary of",
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_readout_record_or_counts_file_is_one_line_in_eval_generate_and_serve(
    headless_dir, how, capsys
):
    """Items 4 and 7: NaN or negative numbers were read as numbers (bpb nan, exit 0; empty
    completions), a truncated counts file, a zero temperature, a list, counts of another
    vocabulary were tracebacks (and `serve` answered every request 500). Each is one line,
    before a model loads, in all three commands."""
    from hlm_ray.serve.app import AppArgs, check_model

    folder = _damage(headless_dir, how)
    for argv in (
        ["generate", "--model", str(folder), "--max-tokens", "2", "hello"],
        ["eval", "--model", str(folder), "--task", "bpb", "--limit", "1"],
    ):
        assert main(argv) == 2, argv
        out = capsys.readouterr()
        err = out.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and DAMAGE[how] in err[0], err
        assert "`hlm data count" in err[0] and out.out == ""  # nothing echoed first
    with pytest.raises(HLMError, match=DAMAGE[how].replace("(", r"\(")):
        check_model(AppArgs(model=str(folder)))


def test_generate_refuses_a_prompt_that_is_not_utf8_and_bad_settings_before_loading(
    headless_dir, capsys, monkeypatch
):
    """Item 8: `hlm generate --model M $'\\xff\\xfe'` was a traceback. Item 11: a bad sampling
    setting came after the model loaded and the prompt (100k characters) was echoed."""
    import hlm_ray.generate

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(hlm_ray.generate.Generator, "load", no_load)
    prompt = b"ok \xff\xfe".decode("utf-8", "surrogateescape")  # how Python hands argv over
    assert main(["generate", "--model", str(headless_dir), prompt]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == (
        "error: the prompt is not UTF-8 text (byte 0xff at character 3); pass it in UTF-8 "
        "(iconv -t utf-8 converts a file)"
    )
    for flags, said in (
        (["--temperature", "-1"], "temperature=-1.0 must be in [0, 100]"),
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--max-tokens", "-2"], "max_new_tokens=-2 must be >= 0"),
    ):
        assert main(["generate", "--model", str(headless_dir), *flags, "x" * 100_000]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith(f"error: {said}") and out.err.count("\n") == 1


@pytest.mark.parametrize("key", ["²", "③", "١", "𝟏", "1.0", " 1", "-1", ""])
def test_logit_bias_keys_are_ascii_decimal_token_ids_only(key):
    """Item 6: "²" and "③" passed `isdigit()` and failed `int()` (HTTP 500 on both routes);
    "١" and "𝟏" were read as token 1. Each is a validation error (answered 400), as OpenAI
    takes ASCII decimal ids only."""
    import json

    from hlm_ray.serve.protocol import ApiError, parse_request
    from hlm_ray.serve.schemas import ChatRequest, CompletionRequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for schema, body in ((CompletionRequest, {"prompt": "x"}), (ChatRequest, chat)):
        with pytest.raises(ApiError, match="token ids written in ASCII digits") as err:
            parse_request(json.dumps({**body, "logit_bias": {key: 1}}).encode(), schema)
        assert err.value.status == 422 and err.value.param == "logit_bias"
        assert schema.model_validate({**body, "logit_bias": {"17": 1}}).bias() == ((17, 1.0),)


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_refuses_a_limit_below_one_instead_of_scoring_the_default(limit, capsys):
    """Item 11: `--limit 0` scored bpb's default 500 passages (`--help` said all), while
    `--limit -1` was refused: both are one line before anything loads."""
    assert main(["eval", "--model", "no-such-model", "--task", "bpb", "--limit", limit]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --limit={limit}: give 1 or more examples per task, or leave --limit out for "
        "each task's default"
    )


def test_data_count_takes_the_run_folders_lock_and_leaves_checkpoints_whole(
    headless_dir, tmp_path, capsys
):
    """Item 9: `hlm data count --model RUN --force` rewrote a running run's counts and
    readout.json mid-run: it takes the run folder's writer lock like every writer. Item 5's
    second cause: counting into a checkpoint made it fail its manifest (then set aside)."""
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(headless_dir, run / "model")
    (run / "launch.json").write_text("{}")
    before = (run / "model" / "token_counts.npz").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from hlm_ray.train.run_lock import acquire; "
         "acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(run)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["data", "count", "--model", str(run), "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {run} is being written by another process (pid ")
        assert err.endswith("wait for the run to end (its model then has its counts) or stop it")
        assert (run / "model" / "token_counts.npz").read_bytes() == before
    finally:
        holder.kill()
        holder.wait()

    checkpoint = fake_checkpoint(run, 10)
    shutil.rmtree(checkpoint / "model")
    shutil.copytree(headless_dir, checkpoint / "model")
    ckpt.write_manifest(checkpoint, {"step": 10})
    assert main(["data", "count", "--model", str(checkpoint), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {checkpoint} is a checkpoint: its files are checked")
    assert ckpt.verify(checkpoint) is None


def test_a_copy_of_a_run_folder_resumes_in_a_new_mlflow_run_not_the_originals(tmp_path, capsys):
    """Item 10: a copy of a run folder, resumed, wrote into the original's MLflow run (its
    mlflow_run.json names it). The folder a reference was written in tells a copy (the
    original still there, naming the same run) from the folder itself or a moved one."""
    import shutil

    from hlm_ray.presets import load_config
    from hlm_ray.tracking.base import copied_from, read_run_ref
    from hlm_ray.train.launch import open_mlflow_run

    original, copy = tmp_path / "run", tmp_path / "run-copy"
    cfg = load_config("tiny-decoder")
    tracker, _ = open_mlflow_run(cfg, original, experiment="test-copies", resume=False)
    tracker.finish("FINISHED")
    shutil.copytree(original, copy)
    ref = read_run_ref(copy)
    assert copied_from(copy, ref) == original and copied_from(original, ref) is None

    capsys.readouterr()  # (MLflow's own lines of a new store)
    again, _ = open_mlflow_run(cfg, copy, experiment="test-copies", resume=True)
    again.finish("FINISHED")
    assert again.run_id != tracker.run_id and read_run_ref(copy)["run_id"] == again.run_id
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"warning: {copy} is a copy of {original} (both name MLflow run {tracker.run_id}): "
        "the copy continues in a new MLflow run"
    )
    same, _ = open_mlflow_run(cfg, original, experiment="test-copies", resume=True)
    same.finish("FINISHED")
    assert same.run_id == tracker.run_id

    moved = tmp_path / "moved"
    original.rename(moved)  # a folder moved, not copied: still its own MLflow run
    assert copied_from(moved, read_run_ref(moved)) is None
