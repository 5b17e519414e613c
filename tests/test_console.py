"""The sweep console: Ray's and Tune's output go to the log, `say` lines to the terminal too."""

import subprocess
import sys
import textwrap

import pytest

from hlm_ray.tune.progress import outcome_label, trial_label


def test_console_to_log_keeps_the_terminal_to_said_lines(tmp_path):
    log = tmp_path / "sweep.log"
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from hlm_ray.console import console_to_log, say
        with console_to_log(Path({str(log)!r})):
            print("a python print")
            os.write(1, b"a C++ line on fd 1\\n")
            os.write(2, b"a warning on fd 2\\n")
            say("trial 1/2 started")
        print("the table")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["trial 1/2 started", "the table"]
    assert done.stderr == ""
    text = log.read_text()
    for line in ("a python print", "a C++ line on fd 1", "a warning on fd 2", "trial 1/2 started"):
        assert line in text
    assert "the table" not in text


def test_trial_progress_labels():
    config = {"value": 1000, "config": {"objective": {"name": "headless"}, "run": {"seed": 1}}}
    assert trial_label(config, "vocab") == "vocab=1000 headless seed 1"
    result = {"downstream/score": 0.51234, "tokens_per_s": 8120.4}
    assert outcome_label(result) == ", score 0.5123, 8,120 tokens/s"
    assert outcome_label({"downstream/score": float("nan")}) == ""
    assert outcome_label(None) == ""


@pytest.mark.parametrize("own", [True, False])
def test_a_sweep_stops_the_cluster_it_started_before_its_console_comes_back(
    own, monkeypatch, tmp_path, capsys
):
    """Ray forwards a worker's output to the driver late (a line a worker flushes at its exit
    came after the demo's link): a sweep on the local cluster it started shuts that cluster down
    while its console still goes to the log, then prints the summary and the link, last. A
    cluster it joined (RAY_ADDRESS, a test's) is left running. `ray.shutdown` is recorded, not
    run: the sweep is a stand-in that returns at once."""
    import ray

    import hlm_ray.console as console
    import hlm_ray.train.launch as launch
    import hlm_ray.tune.sweep as sweep
    from hlm_ray.tune.cli import SweepScript
    from hlm_ray.tune.scripts import load_script

    def finished(spec, *, name, search, assumptions=None, storage_path=None, verbose=0):
        launch._own_cluster = own  # as `connect` leaves it
        rows = [{"status": "FINISHED", "trial_id": "t0", "loss": 1.0}]
        outcome = sweep.SweepOutcome(name, tmp_path, rows, "| table |", [], None, False, 1.0)
        outcome.link = "MLflow: open this"
        return outcome

    stopped = []  # whether the console still went to the log at each shutdown
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(console._current is not None))
    monkeypatch.setattr(launch, "_own_cluster", False)
    monkeypatch.setattr(sweep, "run_sweep", finished)
    monkeypatch.chdir(tmp_path)
    vocab = load_script("vocab")
    main = SweepScript(vocab.AXIS, vocab.PRESETS).main  # no report: it would read the trials
    assert main(["--set", "sweep.values=[512]"]) == 0
    assert stopped == ([True] if own else [])
    assert not launch._own_cluster
    assert capsys.readouterr().out.rstrip().endswith("MLflow: open this")


def test_a_trial_is_numbered_by_its_place_in_the_sweep_also_when_resumed():
    """Tune's trial ids end with the order it made them in and keep it on resume: the line of a
    resumed sweep's fifth trial says 5/6, not 1/2 (the first to start in this run); its time
    says it starts with the resume."""
    from types import SimpleNamespace

    from hlm_ray.tune.progress import TrialProgress, trial_number

    assert trial_number("a1b2c_00004") == 5 and trial_number("odd") is None
    config = {"value": 1000, "config": {"objective": {"name": "headless"}, "run": {"seed": 1}}}
    trial = SimpleNamespace(trial_id="a1b2c_00004", config=config)
    progress = TrialProgress(num_trials=6, short="vocab")
    progress.began[trial.trial_id] = 0.0
    try:
        TrialProgress.resumed = True
        line = progress._line(trial, "finished" + progress._took(trial))
    finally:
        TrialProgress.resumed = False
    assert " trial 5/6 finished in " in line and " s since the sweep resumed: vocab=1000" in line


def test_a_progress_bar_where_the_output_is_not_a_terminal_writes_whole_lines():
    """A Ray worker's tqdm bar: Ray forwards its output line by line, each prefixed with the
    worker; a carriage return or a clearing write showed the prefix over an empty line."""
    import io

    from tqdm import tqdm

    from hlm_ray.console import Lines

    out = io.StringIO()
    bar = tqdm(total=3, desc="headless gpt_neox", file=Lines(out), mininterval=0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    lines = out.getvalue().split("\n")
    assert lines[-1] == "" and "\r" not in out.getvalue()
    assert all(line.startswith("headless gpt_neox:") for line in lines[:-1]), lines
    assert "3/3" in lines[-2]


def test_a_reports_image_links_reach_the_terminal_as_figure_paths(tmp_path):
    """The report's Markdown is printed at the end of a sweep: an image link there is noise
    (`![...](fig7a_...png)`); the figure's path, from where the command ran, is not."""
    from hlm_ray.tune.cli import console_text

    md = "## Figures\n\n![score vs vocabulary](fig7a_score.png)\n\n![](/abs/b.png) and text\n"
    assert console_text(md, tmp_path / "vocab-tiny") == (
        f"## Figures\n\nfigure: {tmp_path}/vocab-tiny/fig7a_score.png (score vs vocabulary)\n\n"
        "figure: /abs/b.png and text\n"
    )
