"""Ctrl-C on a Ray Train run: stop the workers, keep the checkpoints, say how to continue.

Ray's `TorchTrainer.fit` installs its own SIGINT handler (it aborts the controller, then calls
`sys.exit`), so a Ctrl-C never reaches the caller as a `KeyboardInterrupt`. `trainer_class()`
gives a `TorchTrainer` whose handler aborts the controller the same way but only records the
interrupt; `launch` then marks the MLflow run KILLED and raises `RunInterrupted`, which the CLI
turns into the "continue with" line and exit status 130. A second Ctrl-C stops waiting for the
abort (the controller is killed) and raises at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


def sigint_interrupts() -> None:
    """Make SIGINT raise KeyboardInterrupt even when the process started with it ignored: a
    non-interactive shell starts a background job (`hlm train ... &` in a script) with SIGINT
    ignored, and Python then leaves it so; `kill -INT` had no effect on such a run. (The main
    thread only: elsewhere handlers cannot be set.)"""
    with contextlib.suppress(ValueError):
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C ended a run or sweep cleanly: its processes are stopped, its runs marked KILLED."""


def continue_message(
    run_dir: Path,
    output: str,
    argv: list[str],
    config: str | None,
    sets: list[str],
    storage: str | None = None,
) -> str:
    """What `hlm train` says after Ctrl-C: `--resume` (with the --config/--set given again)
    when the run folder, or the run's `storage` (s3://...), holds a valid checkpoint; before
    the first one there is nothing to resume (`--resume` would refuse the folder), so the same
    command again, which starts over (a folder without checkpoints is accepted, its
    metrics.jsonl rewritten)."""
    import shlex

    from hlm_ray.train.checkpoint import latest_valid
    from hlm_ray.train.run_mirror import RunMirror

    mirror = RunMirror.of(run_dir, storage)
    stored = mirror is not None and mirror.has_checkpoints()
    if stored or (run_dir.is_dir() and latest_valid(run_dir, warn=False) is not None):
        again = " ".join(
            ["hlm train --resume", shlex.quote(output)]
            + (["--config", shlex.quote(config)] if config else [])
            + [f"--set {shlex.quote(s)}" for s in sets]
        )
        where = mirror.uri if stored else output
        return (
            f"the run is stopped and marked KILLED; the checkpoints in {where} are intact; "
            f"continue with: {again}"
        )
    return (
        "the run is stopped and marked KILLED before its first checkpoint; "
        f"continue with: {shlex.join(['hlm', *argv])}"
    )


def not_started_message(argv: list[str]) -> str:
    """What `hlm train` says after a Ctrl-C that came before its MLflow run was opened (while
    the tokenizer or corpus was prepared): there is no run to mark or resume."""
    import shlex

    return (
        "the run had not started (no MLflow run was opened, no checkpoint written); "
        f"start it again with: {shlex.join(['hlm', *argv])}"
    )


def trainer_class():
    from ray.train.torch import TorchTrainer

    class InterruptibleTorchTrainer(TorchTrainer):
        interrupted = False

        def _register_sigint_handler(self, controller) -> None:  # overrides Ray's
            import ray

            def handler(signum, frame):
                if self.interrupted:
                    ray.kill(controller)
                    raise KeyboardInterrupt
                self.interrupted = True
                print(
                    "\ninterrupted: stopping the workers (Ctrl-C again to stop waiting)",
                    file=sys.stderr,
                    flush=True,
                )
                controller.abort.remote()  # fit() returns or raises once the workers are gone

            signal.signal(signal.SIGINT, handler)

        def _create_default_callbacks(self):  # extends Ray's
            from ray.train.v2._internal.callbacks import DatasetsCallback

            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            # hlm's workers read their own data: without Ray datasets, the DatasetsCallback
            # would still start a DatasetManager actor per fit, one more process (1.6 s of CPU
            # per sweep trial on 2 cores) that serves nothing.
            return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]

    return InterruptibleTorchTrainer


class restore_sigint:
    """Put the process's SIGINT handler back after a block that may replace it (Ray, Tune)."""

    def __enter__(self):
        self.saved = signal.getsignal(signal.SIGINT)
        return self

    def __exit__(self, *exc):
        # Not the main thread, or a handler set from C: nothing to put back.
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGINT, self.saved)
        return False


class tune_interrupt:
    """Ctrl-C on a sweep: `Tuner.fit()` ends as Tune's own handler would end it (state saved,
    trials stopped), and `interrupted` says so afterwards: Tune then returns normally, with the
    interrupted trials looking like ones an early-stopping scheduler stopped.

        with tune_interrupt() as stop:
            results = tuner.fit()
        if stop.interrupted: ...

    Tune's SIGINT handler is switched off (``TUNE_DISABLE_SIGINT_HANDLER``); ours asks Tune to
    stop through the SIGUSR1 handler it always installs. A second Ctrl-C raises
    `KeyboardInterrupt` at once."""

    ENV = "TUNE_DISABLE_SIGINT_HANDLER"

    def __enter__(self):
        import os

        self.interrupted = False
        self.saved_env = os.environ.get(self.ENV)
        os.environ[self.ENV] = "1"
        self.saved = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        import os

        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        print(
            "\ninterrupted: stopping the trials and saving the sweep's state "
            "(Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        if not callable(signal.getsignal(signal.SIGUSR1)):  # Tune is not listening here
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's "stop the experiment" signal

    def __exit__(self, *exc):
        import os

        if self.saved_env is None:
            os.environ.pop(self.ENV, None)
        else:
            os.environ[self.ENV] = self.saved_env
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGINT, self.saved)
        return False
