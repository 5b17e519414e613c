"""The `hlm` command itself: help on every command and flag, --version, `hlm sweep` as the
sweep scripts, `hlm generate`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from importlib.metadata import version
from pathlib import Path

import pytest

from hlm_ray.cli import SWEEPS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _walk(parser: argparse.ArgumentParser, path: str):
    """(command path, parser) for `parser` and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                assert helps.get(name), f"`{path} {name}` has no help in `{path} --help`"
                yield from _walk(sub, f"{path} {name}")


def test_every_command_has_a_description_and_every_flag_a_help():
    commands = dict(_walk(build_parser(), "hlm"))
    assert {"hlm train", "hlm eval", "hlm sweep vocab", "hlm sweep batch_size"} <= set(commands)
    assert {"hlm generate", "hlm serve", "hlm bench", "hlm data prepare"} <= set(commands)
    missing = []
    for path, parser in commands.items():
        if not parser.description:
            missing.append(f"{path}: no description")
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction) and not action.help:
                missing.append(f"{path}: {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "no help text: " + "; ".join(missing)


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hlm {version('hlm_ray')}"


def test_version_answers_without_importing_torch():
    """`hlm --version` (training.md's first command) took 17 s on a busy 2-core machine, all of
    it building the parser, which imports torch and transformers."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom hlm_ray.cli import main\ntry:\n    main(['--version'])\n"
        "except SystemExit as done:\n    assert done.code == 0\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [f"hlm {version('hlm_ray')}", "False False"]


BAD_INPUT = {  # command line -> the start of its one-line error
    "train --preset tiny-decodr": "error: unknown preset 'tiny-decodr'",
    "train --set optim.max_step=10": "error: unknown config field optim.max_step",
    "train --set optim.lr=abc": "error: optim.lr='abc' is not allowed",
    "train --local --num-workers 0": "error: --local trains in this process, one worker",
    "train --num-workers 0": "error: --num-workers 0: use 1 or more",
    "train --output {file}/run": "error: output {file}/run: {file} is a file",
    "train --resume {nowhere}": "error: ",
    "eval --model {nowhere} --task lambda": "error: unknown evaluation task 'lambda'",
    "eval --model {nowhere} --task lambada": "error: model {nowhere} does not exist",
    "finetune --task glu:sst2 --model {nowhere}": "error: unknown task 'glu:sst2'",
    "generate --model {nowhere} hello": "error: model {nowhere} does not exist",
    "serve --model {nowhere}": "error: model {nowhere} does not exist",
}


def test_bad_input_is_answered_before_torch_is_imported(tmp_path):
    """A mistyped preset, config key or value, flag, task or folder is one `error:` line and
    status 2 before torch, transformers, Ray or MLflow are imported (they cost 17-39 s on a busy
    2-core machine); `hlm presets` too needs none of them. One process runs every case."""
    import subprocess
    import sys

    names = {"file": str(tmp_path / "a-file"), "nowhere": str(tmp_path / "nowhere")}
    (tmp_path / "a-file").write_text("")
    cases = {k.format(**names): v.format(**names) for k, v in BAD_INPUT.items()}
    code = (
        "import contextlib, io, json, shlex, sys\nfrom hlm_ray.cli import main\nout = {}\n"
        "for line in json.loads(sys.argv[1]):\n    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n        code = main(shlex.split(line))\n"
        "    out[line] = [code, err.getvalue()]\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    out['presets'] = [main(['presets']), '']\n"
        "heavy = ('torch', 'transformers', 'ray', 'mlflow')\n"
        "import os\nprint(os.environ.get('OMP_WAIT_POLICY'))\n"
        "print(json.dumps([out, [m for m in heavy if m in sys.modules]]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(cases))],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    *_, policy, result = done.stdout.splitlines()
    answers, imported = json.loads(result)
    assert imported == []
    assert policy == "PASSIVE"  # set for the in-process commands, before torch (threads.py)
    assert answers.pop("presets") == [0, ""]
    for line, start in cases.items():
        code, err = answers[line]
        assert code == 2 and err.startswith(start) and err.count("\n") == 1, (line, err)


def _script(kind: str):
    spec = importlib.util.spec_from_file_location(
        f"test_cli_{kind}", ROOT / "sweeps" / f"{kind}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", SWEEPS)
def test_hlm_sweep_help_lists_the_scripts_flags(kind, capsys):
    from hlm_ray.tune.cli import build_parser as sweep_parser

    script = _script(kind)
    flags = {
        s for a in sweep_parser(script.AXIS, script.PRESETS)._actions for s in a.option_strings
    }
    assert {"--preset", "--set", "--dry-run", "--num-seeds"} <= flags
    with pytest.raises(SystemExit):
        main(["sweep", kind, "--help"])
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: hlm sweep {kind}")
    assert all(flag in shown for flag in flags), flags - {f for f in flags if f in shown}


@pytest.mark.parametrize("kind", SWEEPS)
def test_hlm_sweep_dry_run_prints_the_scripts_plan(kind, capsys):
    # families (headline) and FLOP budgets (scaling): as the preset has them
    values = {"vocab": ["--set", "sweep.values=[512,768]"], "headline": [], "scaling": []}
    argv = ["--preset", "tiny", "--dry-run", *values.get(kind, ["--set", "sweep.values=[8,16]"])]
    assert _script(kind).main(argv) == 0
    expected = capsys.readouterr().out
    assert main(["sweep", kind, *argv]) == 0
    assert capsys.readouterr().out == expected
    assert "nothing started" in expected and "trial(s)" in expected


def test_hlm_sweep_bad_input_is_one_line(capsys):
    assert main(["sweep", "vocab", "--dry-run", "--set", "sweep.values=[]"]) == 2
    assert capsys.readouterr().err.startswith("error: sweep.values is empty")


def test_generate_prints_the_prompt_and_the_generators_sample(tiny_decoder_dir, capsys):
    from hlm_ray.generate import Generator

    argv = ["generate", "--model", tiny_decoder_dir, "The cat", "--max-tokens", "8"]
    assert main([*argv, "--seed", "3", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    [sample] = Generator.load(tiny_decoder_dir).generate("The cat", max_new_tokens=8, seed=3)
    assert printed.out == "The cat" + sample.text + "\n"
    assert "finish_reason=" in printed.err


def test_generate_refuses_a_headless_decoder_that_was_not_finetuned(
    tiny_decoder_dir, tmp_path, capsys
):
    """The refusal reads the folder's config.json and files only (before any weights load):
    the tiny decoder's folder, marked as a headless pretraining run writes it (no
    `hlm_finetuned`), without the token counts its prior readout would need."""
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_decoder_dir, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    config.update(hlm_objective="headless")
    config.pop("hlm_finetuned", None)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("token_counts.npz", "readout.json"):
        (folder / name).unlink()
    assert main(["generate", "--model", str(folder), "hello"]) == 2
    err = capsys.readouterr().err
    assert "headless decoder that was never fine-tuned" in err
    assert "hlm data count --model" in err and "hlm finetune --task clm" in err


def test_an_interrupted_hlm_sweep_prints_the_hlm_command_to_continue(monkeypatch, capsys):
    import hlm_ray.tune.sweep as sweep

    def interrupted(spec, *, name, search, assumptions=None, storage_path=None, verbose=0):
        rows = [{"status": "FINISHED"}, {"status": "KILLED"}]
        return sweep.SweepOutcome(name, None, rows, "", [], None, False, 1.0, interrupted=True)

    monkeypatch.setattr(sweep, "run_sweep", interrupted)
    assert main(["sweep", "batch_size", "--set", "optim.max_steps=20"]) == 130
    err = capsys.readouterr().err
    assert (
        "continue with: hlm sweep batch_size --set optim.max_steps=20 --name batch_size-tiny" in err
    )


def _train_plan_wall_time(capsys, *extra: str) -> str:
    argv = ["train", "--preset", "tiny-decoder", "--dry-run", "--cluster-gpus", "1", *extra]
    assert main(argv) == 0
    [line] = [s for s in capsys.readouterr().out.splitlines() if "expected wall time" in s]
    return line


def test_train_dry_run_adds_the_overhead_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    plain = _train_plan_wall_time(capsys)
    assert "wall time   0 s, training only (no fixed cost" in plain  # unless asked
    with_overhead = _train_plan_wall_time(capsys, "--overhead-s", "7200")
    # Included in the wall time, and said so (it read as extra time).
    assert "wall time   2.0 h, including the fixed cost of 7200 s per trial" in with_overhead
    assert not (tmp_path / "runs").exists()


def test_a_module_run_as_a_command_prints_bad_input_as_one_line(capsys):
    """`python -m hlm_ray.serve.cli` (and the serving benchmark): an HLMError is one `error:`
    line and status 2, no traceback; the command's own status otherwise."""
    from hlm_ray.errors import HLMError, exit_status
    from hlm_ray.serve.cli import main

    assert main(["--model", "runs/does-not-exist"]) == 2  # before any Ray starts
    err = capsys.readouterr().err
    assert err.startswith("error: model runs/does-not-exist does not exist; pass a run folder")
    assert err.count("\n") == 1 and "Traceback" not in err

    def bad() -> int:
        raise HLMError("what was wrong; what to do")

    assert exit_status(bad) == 2 and exit_status(lambda: 7) == 7
    assert capsys.readouterr().err == "error: what was wrong; what to do\n"


def test_a_harness_task_without_the_eval_extra_is_one_line_naming_it(monkeypatch, capsys):
    """Without lm-evaluation-harness, `hlm eval --task harness:...` names the extra before it
    looks for the model (here one that does not exist), not a ModuleNotFoundError traceback."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    code = main(["eval", "--model", "runs/nowhere", "--task", "lambada,harness:lambada_openai"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "pip install -e '.[eval]'" in err


def test_a_failed_evaluation_leaves_no_empty_folder(
    tiny_decoder_dir, tmp_path, monkeypatch, capsys
):
    """A task that fails after the output folder was made left it empty: now it is removed
    (one line, exit 2); a folder that was there before stays."""
    import hlm_ray.evaluate as evaluate
    from hlm_ray.errors import HLMError

    def failing(pre, *, output_dir, **kwargs):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        raise HLMError("the task failed")

    monkeypatch.setattr(evaluate, "get_task", lambda name: failing)
    out = tmp_path / "ev"
    assert main(["eval", "--model", tiny_decoder_dir, "--task", "bpb", "--output", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "error: the task failed"
    assert not out.exists()
    out.mkdir()
    assert main(["eval", "--model", tiny_decoder_dir, "--task", "bpb", "--output", str(out)]) == 2
    assert out.is_dir()


def test_openmp_waits_passively_unless_the_user_says_otherwise(monkeypatch):
    """Spinning OpenMP threads collapse in-process training on shared cores (hlm_ray/threads.py):
    the in-process commands set OMP_WAIT_POLICY=PASSIVE before torch loads libgomp, and keep a
    user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT; once torch is loaded it is too late, and
    nothing is set."""
    import sys

    from hlm_ray.threads import COMMANDS, passive_openmp

    assert {"train", "finetune", "eval", "generate"} <= set(COMMANDS)
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh `hlm` process
    env = {}
    assert passive_openmp(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for own in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        assert not passive_openmp(dict(own))
    monkeypatch.undo()
    assert "torch" in sys.modules and not passive_openmp(env := {}) and env == {}


def test_a_command_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    """A script's background job starts with SIGINT ignored (`hlm train ... &` in a
    non-interactive shell); `hlm` and the sweep scripts make it raise KeyboardInterrupt again,
    so `kill -INT` stops the run as Ctrl-C does. One process, started that way."""
    import signal
    import subprocess
    import sys

    code = (
        "import contextlib, io, signal\nfrom hlm_ray.cli import main\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    main(['presets'])\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert done.stdout.split() == ["True", "True"]
