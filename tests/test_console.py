"""The sweep console: Ray's and Tune's output go to the log, `say` lines to the terminal too."""

import subprocess
import sys
import textwrap

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
